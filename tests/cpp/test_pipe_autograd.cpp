// test_pipe_autograd.cpp — the plain model's autograd semantics: outside tensors, autograd::grad, backward(inputs), hooks, saved-input checks.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::deep_copy;
using gpipe_test::kTolerance;
using gpipe_test::max_abs_diff;
using gpipe_test::randn64;

namespace {

/// x @ w with a `w` the layer does not register: a closure over an outside
/// tensor (a weight tied to another module reads the same way).
class OutsideMatmulImpl : public torch::nn::Cloneable<OutsideMatmulImpl> {
 public:
  explicit OutsideMatmulImpl(torch::Tensor w) : w_(std::move(w)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w_); }

 private:
  torch::Tensor w_;
};
TORCH_MODULE(OutsideMatmul);

/// Ignores its input: a constant float output.
class ConstantImpl : public torch::nn::Cloneable<ConstantImpl> {
 public:
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::ones({x.size(0), 3}, x.options().requires_grad(false));
  }
};
TORCH_MODULE(Constant);

const Checkpoint kModes[] = {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never};

torch::nn::Sequential four_linears() {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 4),
                              torch::nn::Linear(4, 2));
  model->to(torch::kFloat64);
  return model;
}

}  // namespace

TEST_CASE("a tensor outside the layers that requires grad gets the plain model's grad, every mode") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  const bool frozen = GENERATE(false, true);
  INFO("checkpoint " << mode << (frozen ? ", layers frozen" : ""));
  auto w = randn64({3, 3}).requires_grad_(true);
  auto make = [&] {
    torch::manual_seed(1);
    torch::nn::Sequential model(torch::nn::Linear(3, 3), OutsideMatmul(w), torch::nn::Tanh(),
                                OutsideMatmul(w));
    model->to(torch::kFloat64);
    if (frozen) {
      for (auto& p : model->parameters()) p.requires_grad_(false);
    }
    return model;
  };
  auto ref = make();
  gpipe::Pipe pipe(make(), PipeOptions().balance({1, 2, 1}).chunks(3).checkpoint(mode));
  const auto x = randn64({7, 3});

  auto want = ref->forward(x);
  want.pow(2).sum().backward();
  const auto want_w = w.grad().clone();
  w.mutable_grad().reset();

  auto got = pipe->forward(x);
  CHECK(got.requires_grad() == want.requires_grad());
  CHECK(max_abs_diff(got, want) <= kTolerance);
  got.pow(2).sum().backward();
  REQUIRE(w.grad().defined());
  CHECK(max_abs_diff(w.grad(), want_w) <= kTolerance);
  if (!frozen) gpipe_test::check_param_grads(*pipe, *ref);
}

TEST_CASE("an output needs grad exactly where the plain model's does") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  INFO("checkpoint " << mode);
  SECTION("a constant float output does not require grad") {
    torch::nn::Sequential model(torch::nn::Linear(3, 3), Constant());
    model->to(torch::kFloat64);
    gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(2).checkpoint(mode));
    auto out = pipe->forward(randn64({4, 3}));
    CHECK_FALSE(out.requires_grad());
    CHECK(out.grad_fn() == nullptr);
  }
  SECTION("a frozen model on an input without grad gives an output without grad") {
    auto model = four_linears();
    for (auto& p : model->parameters()) p.requires_grad_(false);
    gpipe::Pipe pipe(model, PipeOptions().balance({2, 2}).chunks(2).checkpoint(mode));
    CHECK_FALSE(pipe->forward(randn64({4, 3})).requires_grad());
  }
}

TEST_CASE("on CPU the Pipe's node has an edge per input and per parameter, and no stream leaf") {
  // Stream leaves (pipe_backward.h) only for accelerator devices.
  auto model = four_linears();
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2}).chunks(2));
  auto out = pipe->forward(randn64({4, 3}).requires_grad_());
  REQUIRE(out.grad_fn() != nullptr);
  CHECK(out.grad_fn()->num_outputs() == 1 + model->parameters().size());
  for (const auto& edge : out.grad_fn()->next_edges()) {
    CHECK((edge.function == nullptr || edge.function->name() != "gpipe::StreamLeaf"));
  }
}

TEST_CASE("autograd::grad on the input leaves every parameter's grad alone") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  INFO("checkpoint " << mode);
  auto ref = four_linears();
  gpipe::Pipe pipe(four_linears(), PipeOptions().balance({2, 1, 1}).chunks(3).checkpoint(mode));
  const auto x0 = randn64({5, 3});
  auto x = x0.clone().requires_grad_(true);
  auto xr = x0.clone().requires_grad_(true);

  auto got = torch::autograd::grad({pipe->forward(x).pow(2).sum()}, {x});
  auto want = torch::autograd::grad({ref->forward(xr).pow(2).sum()}, {xr});
  CHECK(max_abs_diff(got[0], want[0]) <= kTolerance);
  for (const auto& p : pipe->parameters()) CHECK_FALSE(p.grad().defined());
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("autograd::grad on the parameters gives the plain model's grads and fills no .grad") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  INFO("checkpoint " << mode);
  auto ref = four_linears();
  gpipe::Pipe pipe(four_linears(), PipeOptions().balance({1, 2, 1}).chunks(4).checkpoint(mode));
  const auto x = randn64({6, 3});
  const auto got = torch::autograd::grad({pipe->forward(x).pow(2).sum()}, pipe->parameters());
  const auto want = torch::autograd::grad({ref->forward(x).pow(2).sum()}, ref->parameters());
  REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    INFO("parameter " << k);
    CHECK(max_abs_diff(got[k], want[k]) <= kTolerance);
  }
  for (const auto& p : pipe->parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("backward(inputs) fills only the grads asked for") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  INFO("checkpoint " << mode);
  auto ref = four_linears();
  gpipe::Pipe pipe(four_linears(), PipeOptions().balance({2, 2}).chunks(2).checkpoint(mode));
  const auto x0 = randn64({4, 3});
  auto x = x0.clone().requires_grad_(true);
  auto xr = x0.clone().requires_grad_(true);
  const auto last_weight = pipe->named_parameters()["3.weight"];

  const std::vector<torch::Tensor> asked{x, last_weight};
  const std::vector<torch::Tensor> asked_ref{xr, ref->named_parameters()["3.weight"]};
  pipe->forward(x).pow(2).sum().backward({}, false, false, at::TensorList(asked));
  ref->forward(xr).pow(2).sum().backward({}, false, false, at::TensorList(asked_ref));
  CHECK(max_abs_diff(x.grad(), xr.grad()) <= kTolerance);
  CHECK(max_abs_diff(last_weight.grad(), ref->named_parameters()["3.weight"].grad()) <=
        kTolerance);
  for (const auto& item : pipe->named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(item.value().grad().defined() == (item.key() == "3.weight"));
  }
}

TEST_CASE("a parameter's hook fires once per backward with the whole mini-batch's grad") {
  auto ref = four_linears();
  gpipe::Pipe pipe(four_linears(), PipeOptions().balance({2, 2}).chunks(4));
  const auto x = randn64({8, 3});
  int calls = 0;
  torch::Tensor seen;
  pipe->named_parameters()["0.weight"].register_hook([&](const torch::Tensor& g) {
    ++calls;
    seen = g.clone();
  });
  pipe->forward(x).pow(2).sum().backward();
  ref->forward(x).pow(2).sum().backward();
  CHECK(calls == 1);
  CHECK(max_abs_diff(seen, ref->named_parameters()["0.weight"].grad()) <= kTolerance);
}

TEST_CASE("an input changed in place after a checkpointed forward raises autograd's error") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  const int64_t chunks = GENERATE(1, 3);
  INFO("checkpoint " << mode << ", chunks " << chunks);
  auto model = four_linears();
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2}).chunks(chunks).checkpoint(mode));
  auto x = randn64({6, 3});
  auto loss = pipe->forward(x).pow(2).sum();
  x.add_(1.0);  // the first Linear saved x for its weight grad
  CHECK_THROWS_WITH(loss.backward(),
                    Catch::Contains("modified by an inplace operation"));
  // The Pipe still works afterwards.
  auto x2 = randn64({6, 3});
  CHECK_NOTHROW(pipe->forward(x2).sum().backward());
}

TEST_CASE("a layer working in place behind a stage that passes its input on stays exact") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  const int64_t chunks = GENERATE(1, 2, 4);
  const bool input_grad = GENERATE(false, true);
  INFO("checkpoint " << mode << ", chunks " << chunks << (input_grad ? ", input needs grad" : ""));
  auto make = [] {
    torch::manual_seed(5);
    torch::nn::Sequential model(torch::nn::Identity(),
                                torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                torch::nn::Linear(3, 2));
    model->to(torch::kFloat64);
    return model;
  };
  auto ref = make();
  gpipe::Pipe pipe(make(), PipeOptions().balance({1, 2}).chunks(chunks).checkpoint(mode));
  for (int step = 0; step < 2; ++step) {
    const auto x0 = randn64({8, 3});
    auto x = x0.clone().requires_grad_(input_grad);
    auto xr = x0.clone().requires_grad_(input_grad);
    // The plain model's ReLU_ would refuse a leaf that requires grad: give
    // it what the Pipe's first stage gives the second, a non-leaf alias.
    auto want = ref->forward(input_grad ? xr * 1.0 : xr);
    auto got = pipe->forward(x);
    CHECK(max_abs_diff(got, want) <= kTolerance);
    want.pow(2).sum().backward();
    got.pow(2).sum().backward();
    gpipe_test::check_param_grads(*pipe, *ref);
    if (input_grad) CHECK(max_abs_diff(x.grad(), xr.grad()) <= kTolerance);
  }
}
