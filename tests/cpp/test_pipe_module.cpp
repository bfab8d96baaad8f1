// test_pipe_module.cpp — a Pipe behaves as a torch::nn::Module: the Sequential's state, modes, layers, casts, several inputs.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <sstream>
#include <vector>

using Catch::Contains;
using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::check_param_grads;
using gpipe_test::deep_copy;
using gpipe_test::keys_of;
using gpipe_test::kTolerance;
using gpipe_test::max_abs_diff;
using gpipe_test::randn64;

namespace {

// Linear BatchNorm1d ReLU Linear: parameters and buffers.
torch::nn::Sequential with_batchnorm() {
  torch::manual_seed(8);
  using namespace torch::nn;
  Sequential model(Linear(4, 6), BatchNorm1d(6), ReLU(), Linear(6, 2));
  model->to(torch::kFloat64);
  return model;
}

// Two tensors in, [a, b] -> [W1 a, tanh(W2 b) * a.sum(1)] -> sum -> Linear.
class PairLinearImpl : public torch::nn::Cloneable<PairLinearImpl> {
 public:
  PairLinearImpl() { reset(); }
  void reset() override {
    first = register_module("first", torch::nn::Linear(3, 4));
    second = register_module("second", torch::nn::Linear(2, 4));
  }
  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> xs) {
    return {first(xs.at(0)), torch::tanh(second(xs.at(1))) * xs.at(0).sum(1, true)};
  }
  torch::nn::Linear first{nullptr};
  torch::nn::Linear second{nullptr};
};
TORCH_MODULE(PairLinear);

class SumPairImpl : public torch::nn::Cloneable<SumPairImpl> {
 public:
  void reset() override {}
  torch::Tensor forward(std::vector<torch::Tensor> xs) { return xs.at(0) * xs.at(1) + xs.at(1); }
};
TORCH_MODULE(SumPair);

// Returns its input twice: a last layer that makes the Pipe return a list.
class TwiceImpl : public torch::nn::Cloneable<TwiceImpl> {
 public:
  void reset() override {}
  std::vector<torch::Tensor> forward(const torch::Tensor& x) { return {x, x * 3.0}; }
};
TORCH_MODULE(Twice);

}  // namespace

TEST_CASE("module: parameters and buffers keep the Sequential's names", "[module]") {
  auto model = with_batchnorm();
  const auto params = keys_of(model->named_parameters());
  const auto buffers = keys_of(model->named_buffers());
  const auto param_tensors = model->parameters();
  REQUIRE(buffers.size() == 3);  // running_mean, running_var, num_batches_tracked
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2, 1}));

  CHECK(keys_of(pipe->named_parameters()) == params);
  CHECK(keys_of(pipe->named_buffers()) == buffers);
  CHECK(params.front() == "0.weight");
  CHECK(buffers.front() == "1.running_mean");
  // The very same tensors: an optimizer on pipe->parameters() trains the layers.
  const auto pipe_params = pipe->parameters();
  REQUIRE(pipe_params.size() == param_tensors.size());
  for (size_t k = 0; k < pipe_params.size(); ++k) CHECK(pipe_params[k].is_same(param_tensors[k]));
}

TEST_CASE("module: a saved Pipe loads into a Sequential and back", "[module]") {
  auto model = with_batchnorm();
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2}).chunks(2));
  pipe->forward(randn64({6, 4}));  // moves the batch norm statistics
  std::stringstream saved;
  torch::save(pipe, saved);

  auto plain = with_batchnorm();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : plain->parameters()) p.add_(1.0);
  }
  torch::load(plain, saved);
  for (const auto& item : pipe->named_parameters()) {
    CHECK(max_abs_diff(plain->named_parameters()[item.key()], item.value()) == 0.0);
  }
  for (const auto& item : pipe->named_buffers()) {
    CHECK(max_abs_diff(plain->named_buffers()[item.key()], item.value()) == 0.0);
  }
}

TEST_CASE("module: train and eval reach every layer", "[module]") {
  auto model = with_batchnorm();
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1, 1}));
  pipe->eval();
  CHECK_FALSE(pipe->is_training());
  for (size_t i = 0; i < pipe->size(); ++i) CHECK_FALSE(pipe->ptr(i)->is_training());
  pipe->train();
  CHECK(pipe->is_training());
  for (size_t i = 0; i < pipe->size(); ++i) CHECK(pipe->ptr(i)->is_training());
}

TEST_CASE("module: layer access like a Sequential", "[module]") {
  auto model = with_batchnorm();
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  for (size_t i = 0; i < model->size(); ++i) layers.push_back(model->ptr(i));
  gpipe::Pipe pipe(model, PipeOptions().balance({3, 1}));
  REQUIRE(pipe->size() == 4);
  for (size_t i = 0; i < layers.size(); ++i) {
    CHECK(pipe->ptr(i).get() == layers[i].get());
    CHECK((*pipe)[i].get() == layers[i].get());
  }
  CHECK(pipe->at<torch::nn::LinearImpl>(3).weight.sizes() == torch::IntArrayRef({2, 6}));
  CHECK(pipe->ptr(1)->as<torch::nn::BatchNorm1dImpl>() == layers[1].get());
  CHECK(&pipe->at<torch::nn::LinearImpl>(0) == layers[0].get());
  CHECK(pipe->sequential().ptr() == model.ptr());
  CHECK_THROWS_WITH(pipe->ptr(4), Contains("index 4") && Contains("4 layers"));
}

TEST_CASE("module: accessors return the resolved options", "[module]") {
  const std::vector<c10::Device> four(4, c10::Device(c10::kCPU));
  gpipe::Pipe given(with_batchnorm(), PipeOptions().balance({1, 3}).devices(four).chunks(5)
                                          .checkpoint(Checkpoint::Never));
  CHECK(given->balance() == std::vector<int64_t>{1, 3});
  CHECK(given->devices() == std::vector<c10::Device>(2, c10::Device(c10::kCPU)));  // extras dropped
  CHECK(given->chunks() == 5);
  CHECK(given->checkpoint() == Checkpoint::Never);
  CHECK(given->options().devices().size() == 2);

  if (!torch::cuda::is_available()) {
    gpipe::Pipe defaults(with_batchnorm(), PipeOptions().balance({2, 1, 1}));
    CHECK(defaults->devices() == std::vector<c10::Device>(3, c10::Device(c10::kCPU)));
    CHECK(defaults->chunks() == 1);
    CHECK(defaults->checkpoint() == Checkpoint::ExceptLast);
  }
  std::ostringstream printed;
  printed << *given;
  CHECK_THAT(printed.str(), Contains("gpipe::Pipe(balance={1, 3}") && Contains("chunks=5") &&
                                Contains("checkpoint=never"));
}

TEST_CASE("module: casting a Pipe with to(dtype)", "[module]") {
  torch::manual_seed(2);
  using namespace torch::nn;
  Sequential model(Linear(4, 8), ReLU(ReLUOptions().inplace(true)), Linear(8, 2));  // float32
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2}).chunks(2));
  pipe->to(torch::kFloat64);
  ref->to(torch::kFloat64);
  for (const auto& p : pipe->parameters()) CHECK(p.scalar_type() == torch::kFloat64);
  const auto x = randn64({6, 4});
  auto out = pipe->forward(x);
  CHECK(out.scalar_type() == torch::kFloat64);
  CHECK(max_abs_diff(out, ref->forward(x)) <= kTolerance);
}

TEST_CASE("module: moving a Pipe to a device is refused", "[module]") {
  gpipe::Pipe pipe(with_batchnorm(), PipeOptions().balance({2, 2}));
  REQUIRE_THROWS_AS(pipe->to(torch::kCPU), c10::Error);
  CHECK_THROWS_WITH(pipe->to(torch::kCPU),
                    Contains("cannot be moved") && Contains("devices(") && Contains("to(dtype)"));
  CHECK_THROWS_WITH(pipe->to(torch::Device(torch::kCPU), torch::kFloat32),
                    Contains("cannot be moved"));
  // Nothing was changed by the refused calls.
  for (const auto& p : pipe->parameters()) CHECK(p.scalar_type() == torch::kFloat64);
}

TEST_CASE("module: several inputs through forward_tuple are transparent", "[module]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  const auto chunks = GENERATE(as<int64_t>{}, 1, 3);
  CAPTURE(mode, chunks);
  torch::manual_seed(6);
  torch::nn::Sequential model(PairLinear(), SumPair(), torch::nn::Linear(4, 2));
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  // Stage 0 hands two tensors to stage 1, whose first layer takes the list.
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1}).chunks(chunks).checkpoint(mode));

  const auto a = randn64({7, 3});
  const auto b = randn64({7, 2});
  auto a_pipe = a.clone().requires_grad_(true);
  auto b_pipe = b.clone().requires_grad_(true);
  auto a_ref = a.clone().requires_grad_(true);
  auto b_ref = b.clone().requires_grad_(true);
  auto outs = pipe->forward_tuple(std::vector<torch::Tensor>{a_pipe, b_pipe});
  REQUIRE(outs.size() == 1);
  auto out_ref = ref->forward<torch::Tensor>(std::vector<torch::Tensor>{a_ref, b_ref});
  CHECK(max_abs_diff(outs[0], out_ref) <= kTolerance);

  const auto w = randn64({7, 2});
  (outs[0] * w).sum().backward();
  (out_ref * w).sum().backward();
  CHECK(max_abs_diff(a_pipe.grad(), a_ref.grad()) <= kTolerance);
  CHECK(max_abs_diff(b_pipe.grad(), b_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
}

TEST_CASE("module: a last layer returning a list needs forward_tuple", "[module]") {
  torch::nn::Sequential model(torch::nn::Linear(3, 3), Twice());
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(2));
  CHECK_THROWS_WITH(pipe->forward(torch::randn({4, 3})),
                    Contains("returned 2 tensors") &&
                        Contains("forward_tuple"));
}

TEST_CASE("module: a list in and a list out through forward_tuple", "[module]") {
  torch::manual_seed(9);
  auto model = torch::nn::Sequential(PairLinear(), SumPair(), Twice());
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2}).chunks(2));
  const auto a = randn64({5, 3});
  const auto b = randn64({5, 2});
  auto a_pipe = a.clone().requires_grad_(true);
  auto a_ref = a.clone().requires_grad_(true);
  auto outs = pipe->forward_tuple(std::vector<torch::Tensor>{a_pipe, b});
  const auto want = ref->forward<std::vector<torch::Tensor>>(std::vector<torch::Tensor>{a_ref, b});
  REQUIRE(outs.size() == 2);
  CHECK(max_abs_diff(outs[0], want[0]) <= kTolerance);
  CHECK(max_abs_diff(outs[1], want[1]) <= kTolerance);
  // Grads reach both outputs' graphs; b needs none.
  (outs[0].sum() + outs[1].pow(2).sum()).backward();
  (want[0].sum() + want[1].pow(2).sum()).backward();
  CHECK(max_abs_diff(a_pipe.grad(), a_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
}

TEST_CASE("module: clone() is a deep copy on the same devices with the same options",
          "[module]") {
  auto model = with_batchnorm();
  auto reference = deep_copy(model);
  // One micro-batch: BatchNorm then sees the plain model's batch.
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2}).chunks(1).checkpoint(Checkpoint::Always));
  auto copied = std::dynamic_pointer_cast<gpipe::PipeImpl>(pipe->clone());
  REQUIRE(copied != nullptr);
  CHECK(copied->balance() == pipe->balance());
  CHECK(copied->devices() == pipe->devices());
  CHECK(copied->chunks() == 1);
  CHECK(copied->checkpoint() == Checkpoint::Always);
  CHECK(keys_of(copied->named_parameters()) == keys_of(pipe->named_parameters()));
  CHECK(keys_of(copied->named_buffers()) == keys_of(pipe->named_buffers()));
  // Its own tensors, equal in value: training the copy leaves the original as it was.
  auto original = pipe->named_parameters();
  for (const auto& p : copied->named_parameters()) {
    CHECK(p.value().data_ptr() != original[p.key()].data_ptr());
    CHECK(torch::equal(p.value(), original[p.key()]));
  }
  const auto x = randn64({6, 4});
  copied->forward(x).sum().backward();
  for (const auto& p : pipe->parameters()) CHECK_FALSE(p.grad().defined());
  // The copy computes what the plain model computes.
  reference->zero_grad();
  reference->forward(x).sum().backward();
  check_param_grads(*copied, *reference);
}

TEST_CASE("module: clone(device) is refused with gpipe's own message", "[module]") {
  gpipe::Pipe pipe(with_batchnorm(), PipeOptions().balance({2, 2}));
  CHECK_THROWS_WITH(pipe->clone(torch::Device(torch::kCPU)),
                    Contains("clone(cpu)") && Contains("clone() with no device") &&
                        !Contains("Cloneable"));
}

namespace {
// A layer that is a plain torch::nn::Module, not a Cloneable.
struct PlainDoubleImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return 2 * x; }
};
TORCH_MODULE(PlainDouble);
}  // namespace

TEST_CASE("module: clone() refuses tied layers and layers that cannot be cloned, by name",
          "[module]") {
  auto w = torch::randn({3, 3}, torch::kFloat64).requires_grad_(true);
  torch::nn::Sequential model{gpipe_test::SharedWeight(w), torch::nn::Tanh(),
                              gpipe_test::SharedWeight(w)};
  gpipe::Pipe tied(model, PipeOptions().balance({2, 1}));
  CHECK_THROWS_WITH(tied->clone(), Contains("layers 0 and 2 share a parameter"));
  gpipe::Pipe plain(torch::nn::Sequential(torch::nn::Linear(3, 3), PlainDouble()),
                    PipeOptions().balance({1, 1}));
  CHECK_THROWS_WITH(plain->clone(), Contains("layer 1 (") && Contains("cannot be cloned") &&
                                        Contains("torch::nn::Cloneable"));
}
