// test_pipe_training.cpp — drop-in training: optimizer steps through a Pipe land where the Sequential's land.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <functional>
#include <memory>

using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::check_param_values;
using gpipe_test::deep_copy;
using gpipe_test::kTolerance;
using gpipe_test::max_abs_diff;
using gpipe_test::randn64;

namespace {

// Linear(6,16) Tanh | Linear(16,16) ReLU_ | Linear(16,2) under balance {2,2,1}.
torch::nn::Sequential regression_mlp() {
  torch::manual_seed(3);
  using namespace torch::nn;
  Sequential model(Linear(6, 16), Tanh(), Linear(16, 16), ReLU(ReLUOptions().inplace(true)),
                   Linear(16, 2));
  model->to(torch::kFloat64);
  return model;
}

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// Trains the Pipe and a copy of its Sequential side by side on the same
// mini-batches; after every step the losses and all parameters agree.
void check_training_matches(const MakeOptimizer& make, Checkpoint mode, int steps) {
  auto model = regression_mlp();
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2, 1}).chunks(4).checkpoint(mode));
  auto opt_pipe = make(pipe->parameters());
  auto opt_ref = make(ref->parameters());

  const auto before = pipe->named_parameters()["0.weight"].clone();
  for (int step = 0; step < steps; ++step) {
    CAPTURE(step);
    const auto x = randn64({10, 6});  // 4 micro-batches of 3, 3, 3, 1 rows
    const auto y = randn64({10, 2});

    opt_pipe->zero_grad();
    auto loss_pipe = torch::mse_loss(pipe->forward(x), y);
    loss_pipe.backward();
    opt_pipe->step();

    opt_ref->zero_grad();
    auto loss_ref = torch::mse_loss(ref->forward(x), y);
    loss_ref.backward();
    opt_ref->step();

    CHECK(std::abs(loss_pipe.item<double>() - loss_ref.item<double>()) <= kTolerance);
    check_param_values(*pipe, *ref);
  }
  // The optimizer really moved the Pipe's parameters (they are the ones it holds).
  CHECK(max_abs_diff(before, pipe->named_parameters()["0.weight"]) > 1e-6);
}

}  // namespace

TEST_CASE("training: SGD with momentum through a Pipe matches the Sequential", "[training]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  check_training_matches(
      [](std::vector<torch::Tensor> params) {
        return std::make_unique<torch::optim::SGD>(
            params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
      },
      mode, /*steps=*/6);
}

TEST_CASE("training: Adam through a Pipe matches the Sequential", "[training]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  check_training_matches(
      [](std::vector<torch::Tensor> params) {
        return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
      },
      mode, /*steps=*/6);
}

TEST_CASE("training: the loss goes down through a Pipe", "[training]") {
  // A sanity check on the loop itself: fitting a fixed batch for a few
  // dozen steps lowers the loss clearly.
  auto model = regression_mlp();
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2, 1}).chunks(4));
  torch::optim::Adam adam(pipe->parameters(), torch::optim::AdamOptions(1e-2));
  const auto x = randn64({16, 6});
  const auto y = randn64({16, 2});
  double first = 0.0;
  double last = 0.0;
  for (int step = 0; step < 40; ++step) {
    adam.zero_grad();
    auto loss = torch::mse_loss(pipe->forward(x), y);
    loss.backward();
    adam.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  CHECK(last < 0.7 * first);
}
