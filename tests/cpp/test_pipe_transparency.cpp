// test_pipe_transparency.cpp — the contract: a Pipe computes what its Sequential computes, outputs and every grad.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <vector>

using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::check_param_grads;
using gpipe_test::deep_copy;
using gpipe_test::inplace_mlp;
using gpipe_test::kTolerance;
using gpipe_test::max_abs_diff;
using gpipe_test::randn64;

namespace {

// Balances of inplace_mlp's six layers: one stage; one layer per stage (stages
// 1 and 3 are a lone in-place layer); uneven, stages 1 and 2 start in place.
const std::vector<std::vector<int64_t>> kBalances = {{6}, {1, 1, 1, 1, 1, 1}, {1, 2, 3}};

// Forward and backward through a Pipe and through a deep copy of the same
// Sequential; compares the output, the input grad and every parameter grad.
// The loss weights each output element differently, so every output grad
// is distinct.
void check_transparent(const PipeOptions& options, int64_t rows, bool input_requires_grad) {
  auto model = inplace_mlp(/*seed=*/rows);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, options);

  const auto x = randn64({rows, 4});
  const auto weight = randn64({rows, 3});
  auto x_pipe = x.clone().requires_grad_(input_requires_grad);
  auto x_ref = x.clone().requires_grad_(input_requires_grad);

  auto out_pipe = pipe->forward(x_pipe);
  auto out_ref = ref->forward(x_ref);
  REQUIRE(out_pipe.sizes() == out_ref.sizes());
  CHECK(max_abs_diff(out_pipe, out_ref) <= kTolerance);
  REQUIRE(out_pipe.requires_grad());
  REQUIRE(out_pipe.grad_fn() != nullptr);

  (out_pipe * weight).sum().backward();
  (out_ref * weight).sum().backward();
  if (input_requires_grad) {
    REQUIRE(x_pipe.grad().defined());
    CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  } else {
    CHECK_FALSE(x_pipe.grad().defined());
  }
  check_param_grads(*pipe, *ref);
}

void check_all_shapes(Checkpoint mode) {
  const auto chunks = GENERATE(as<int64_t>{}, 1, 2, 3, 4, 8);
  // Divisible by chunks, not divisible, fewer rows than chunks.
  const auto rows = GENERATE(as<int64_t>{}, 8, 7, 3);
  const auto balance = GENERATE(from_range(kBalances));
  CAPTURE(mode, chunks, rows, balance);
  check_transparent(PipeOptions().balance(balance).chunks(chunks).checkpoint(mode), rows,
                    /*input_requires_grad=*/true);
}

}  // namespace

TEST_CASE("transparency: all shapes and balances, checkpoint always", "[transparency]") {
  check_all_shapes(Checkpoint::Always);
}

TEST_CASE("transparency: all shapes and balances, checkpoint except_last", "[transparency]") {
  check_all_shapes(Checkpoint::ExceptLast);
}

TEST_CASE("transparency: all shapes and balances, checkpoint never", "[transparency]") {
  check_all_shapes(Checkpoint::Never);
}

TEST_CASE("transparency: the model really has in-place layers at stage starts", "[transparency]") {
  // Guards the tests above against a model that no longer exercises the
  // boundary: the layers must work in place, change their input, and (the
  // LeakyReLU) give a different result when applied twice.
  auto model = inplace_mlp();
  auto& relu = model->at<torch::nn::ReLUImpl>(1);
  auto& leaky = model->at<torch::nn::LeakyReLUImpl>(3);
  REQUIRE(relu.options.inplace());
  REQUIRE(leaky.options.inplace());
  torch::NoGradGuard no_grad;
  auto h = model->at<torch::nn::LinearImpl>(0).forward(randn64({8, 4}));
  CHECK((h < 0).any().item<bool>());
  const auto before = h.clone();
  auto once = leaky.forward(h);
  CHECK(once.data_ptr() == h.data_ptr());
  CHECK(max_abs_diff(once, before) > 0.0);
  const auto kept = once.clone();
  CHECK(max_abs_diff(leaky.forward(once), kept) > 0.0);
  CHECK(relu.forward(h).data_ptr() == h.data_ptr());
}

TEST_CASE("transparency: an input that does not require grad", "[transparency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  const auto chunks = GENERATE(as<int64_t>{}, 1, 4);
  const auto balance = GENERATE(from_range(kBalances));
  CAPTURE(mode, chunks, balance);
  check_transparent(PipeOptions().balance(balance).chunks(chunks).checkpoint(mode), 7,
                    /*input_requires_grad=*/false);
}

TEST_CASE("transparency: eval mode reaches the layers and matches", "[transparency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  // Dropout makes the check able to fail: were any layer still training,
  // the outputs would differ.
  torch::manual_seed(1);
  using namespace torch::nn;
  Sequential model(Linear(4, 8), Dropout(0.5), ReLU(ReLUOptions().inplace(true)), Linear(8, 8),
                   Dropout(0.5), Linear(8, 2));
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2, 2}).chunks(3).checkpoint(mode));
  pipe->eval();
  ref->eval();

  const auto x = randn64({9, 4});
  auto x_pipe = x.clone().requires_grad_(true);
  auto x_ref = x.clone().requires_grad_(true);
  auto out_pipe = pipe->forward(x_pipe);
  auto out_ref = ref->forward(x_ref);
  CHECK(max_abs_diff(out_pipe, out_ref) <= kTolerance);
  // Eval mode is not no-grad: the graph is still there.
  out_pipe.sum().backward();
  out_ref.sum().backward();
  CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
}

TEST_CASE("transparency: NoGradGuard runs without a graph", "[transparency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  const auto balance = GENERATE(from_range(kBalances));
  CAPTURE(mode, balance);
  auto model = inplace_mlp();
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance(balance).chunks(4).checkpoint(mode));
  const auto x = randn64({10, 4}).requires_grad_(true);

  torch::Tensor out_pipe;
  torch::Tensor out_ref;
  {
    torch::NoGradGuard no_grad;
    out_pipe = pipe->forward(x);
    out_ref = ref->forward(x);
  }
  CHECK(max_abs_diff(out_pipe, out_ref) <= kTolerance);
  CHECK_FALSE(out_pipe.requires_grad());
  CHECK(out_pipe.grad_fn() == nullptr);
  // With grad mode back on, the same Pipe builds a graph again.
  auto again = pipe->forward(x);
  CHECK(again.requires_grad());
  CHECK(max_abs_diff(again, out_ref) <= kTolerance);
}

TEST_CASE("transparency: retain_graph allows a second backward", "[transparency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  auto model = inplace_mlp();
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2, 3}).chunks(3).checkpoint(mode));
  const auto x = randn64({8, 4});
  auto x_pipe = x.clone().requires_grad_(true);
  auto x_ref = x.clone().requires_grad_(true);
  const auto weight = randn64({8, 3});
  auto loss_pipe = (pipe->forward(x_pipe) * weight).sum();
  auto loss_ref = (ref->forward(x_ref) * weight).sum();

  // Grads accumulate over both backward calls, as in the Sequential.
  loss_pipe.backward({}, /*retain_graph=*/true);
  loss_ref.backward({}, /*retain_graph=*/true);
  loss_pipe.backward();
  loss_ref.backward();
  CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);

  // The graph is now freed: a third backward is refused, as in the Sequential.
  CHECK_THROWS_AS(loss_ref.backward(), c10::Error);
  CHECK_THROWS_AS(loss_pipe.backward(), c10::Error);
}

TEST_CASE("transparency: grads accumulate over two mini-batches", "[transparency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  auto model = inplace_mlp();
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1, 1, 1, 1}).chunks(2).checkpoint(mode));
  for (int step = 0; step < 2; ++step) {
    const auto x = randn64({5, 4});
    pipe->forward(x).pow(2).sum().backward();
    ref->forward(x).pow(2).sum().backward();
  }
  check_param_grads(*pipe, *ref);
}

namespace {

// Keeps what passes through it in forward; a recompute must bring bitwise
// one of those again (counted in `mismatches` otherwise).
struct RecomputeProbeImpl : torch::nn::Cloneable<RecomputeProbeImpl> {
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (!gpipe::is_recomputing()) {
      seen.push_back(x.detach().clone());
    } else {
      ++recomputes;
      bool found = false;
      for (const auto& s : seen) found |= s.sizes() == x.sizes() && torch::equal(s, x.detach());
      mismatches += found ? 0 : 1;
    }
    return x;
  }
  std::vector<torch::Tensor> seen;
  int recomputes = 0;
  int mismatches = 0;
};
TORCH_MODULE(RecomputeProbe);

}  // namespace

// The first checkpointed cell of a stage copies its input (whether the
// layers change it in place is not known yet), and a stage that does change
// it recomputes from a copy. A GEMM on a copy need not give the bits it gives
// on the original: this CPU's BLAS takes another path for data at another
// alignment, so an input at an odd offset (a slice of a larger tensor) made
// recomputes differ from their forwards in the last bits (and the first
// step's grads from later steps'). Both fixed: the cell that learns the input
// is kept recomputes from the input itself, and copies keep the original's
// offset from a 64-byte boundary.
TEST_CASE("transparency: a checkpointed micro-batch recomputes bitwise what its forward computed",
          "[transparency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast);
  const auto offset = GENERATE(as<int64_t>{}, 0, 1, 3);
  const bool in_place_first = GENERATE(false, true);
  CAPTURE(mode, offset, in_place_first);
  torch::manual_seed(0);
  auto probe = RecomputeProbe();
  torch::nn::Sequential model(torch::nn::Linear(5, 5), probe, torch::nn::Tanh(),
                              torch::nn::Linear(5, 5));
  if (in_place_first) {  // the stage changes its input: it recomputes from a copy
    model = torch::nn::Sequential(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                  torch::nn::Linear(5, 5), probe, torch::nn::Tanh(),
                                  torch::nn::Linear(5, 5));
  }
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({static_cast<int64_t>(model->size())})
                              .chunks(2)
                              .checkpoint(mode));
  const auto big = randn64({offset + 6, 5});
  const auto x = big.slice(0, offset, offset + 6);  // a view at `offset` rows

  std::vector<std::vector<torch::Tensor>> grads;
  for (int step = 0; step < 3; ++step) {
    pipe->zero_grad();
    for (auto& p : pipe->parameters()) p.mutable_grad() = torch::Tensor();
    probe->seen.clear();
    pipe->forward(x).pow(2).sum().backward();
    CHECK(probe->recomputes == (mode == Checkpoint::Always ? 2 : 1));
    CHECK(probe->mismatches == 0);
    probe->mismatches = 0;
    probe->recomputes = 0;
    std::vector<torch::Tensor> g;
    for (const auto& p : pipe->parameters()) g.push_back(p.grad().clone());
    grads.push_back(g);
  }
  for (int step = 1; step < 3; ++step) {
    for (size_t k = 0; k < grads[0].size(); ++k) {
      INFO("step " << step << ", parameter " << k);
      CHECK(torch::equal(grads[static_cast<size_t>(step)][k], grads[0][k]));
    }
  }
  ref->forward(x).pow(2).sum().backward();
  check_param_grads(*pipe, *ref);
}
