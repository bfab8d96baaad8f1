// test_pipe_faults.cpp — failure is loud and clean: any cell's exception names its cell, nothing hangs, the Pipe recovers.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using Catch::Contains;
using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::check_param_grads;
using gpipe_test::deep_copy;
using gpipe_test::FaultPhase;
using gpipe_test::FaultPlan;
using gpipe_test::kTolerance;
using gpipe_test::marked_input;
using gpipe_test::max_abs_diff;
using gpipe_test::phase_word;
using gpipe_test::Sleep;
using gpipe_test::within_deadline;
using gpipe_test::zero_grads;

namespace {

constexpr int64_t kStages = 3;
constexpr int64_t kMicrobatches = 4;

torch::nn::Sequential faulty_model(const std::shared_ptr<FaultPlan>& plan) {
  return gpipe_test::faulty_model(plan, kStages);
}

gpipe::Pipe faulty_pipe(torch::nn::Sequential model, Checkpoint mode) {
  return gpipe::Pipe(model, PipeOptions().balance({2, 2, 2}).chunks(kMicrobatches).checkpoint(mode));
}

// One training step; the exception it raised, if any.
std::exception_ptr step(gpipe::Pipe& pipe, const torch::Tensor& x) {
  return within_deadline([&]() -> std::exception_ptr {
    try {
      pipe->forward(x).pow(2).sum().backward();
      return nullptr;
    } catch (...) {
      return std::current_exception();
    }
  });
}

// The error names the cell, is a CellError, a c10::Error and a
// std::exception, and carries the layer's own exception untouched.
void check_cell_error(const std::exception_ptr& error, int64_t stage, int64_t mb, FaultPhase phase) {
  REQUIRE(error != nullptr);
  const std::string boom = "boom at stage " + std::to_string(stage);
  const std::string where = "stage " + std::to_string(stage) + ", micro-batch " + std::to_string(mb);
  CHECK_THROWS_AS(std::rethrow_exception(error), c10::Error);
  CHECK_THROWS_WITH(std::rethrow_exception(error), Contains(boom));
  try {
    std::rethrow_exception(error);
  } catch (const gpipe::CellError& e) {
    CHECK(e.stage() == stage);
    CHECK(e.microbatch() == mb);
    CHECK(e.phase() == phase_word(phase));
    const std::string what = e.what();
    CHECK_THAT(what, Contains(boom) && Contains(where) && Contains(phase_word(phase)));
    CHECK_THROWS_WITH(std::rethrow_exception(e.original()), boom);
    CHECK_THROWS_AS(std::rethrow_exception(e.original()), std::runtime_error);
  } catch (const std::exception& e) {
    FAIL("not a gpipe::CellError: " << e.what());
  }
}

// After a failure, the same Pipe computes what the Sequential computes.
void check_recovered(gpipe::Pipe& pipe, torch::nn::Sequential& ref, FaultPlan& plan) {
  plan.disarm();
  zero_grads(*pipe);
  zero_grads(*ref);
  const auto x = marked_input(8, 6, kMicrobatches);
  auto x_pipe = x.clone().requires_grad_(true);
  auto x_ref = x.clone().requires_grad_(true);
  torch::Tensor out_pipe;
  REQUIRE(step(pipe, x_pipe) == nullptr);
  auto out_ref = ref->forward(x_ref);
  out_ref.pow(2).sum().backward();
  {
    torch::NoGradGuard no_grad;
    out_pipe = pipe->forward(x);
  }
  CHECK(max_abs_diff(out_pipe, out_ref) <= kTolerance);
  CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
}

void check_fault(FaultPhase phase, Checkpoint mode) {
  const auto stage = GENERATE(range<int64_t>(0, kStages));
  const auto mb = GENERATE(range<int64_t>(0, kMicrobatches));
  CAPTURE(phase_word(phase), mode, stage, mb);
  auto plan = std::make_shared<FaultPlan>();
  auto model = faulty_model(plan);
  auto ref = deep_copy(model);
  auto pipe = faulty_pipe(model, mode);

  plan->arm(stage, mb, phase);
  const auto x = marked_input(8, 6, kMicrobatches).requires_grad_(true);
  check_cell_error(step(pipe, x), stage, mb, phase);
  check_recovered(pipe, ref, *plan);
}

}  // namespace

TEST_CASE("faults: a throw in any forward cell names it", "[faults]") {
  check_fault(FaultPhase::Forward, GENERATE(Checkpoint::Never, Checkpoint::Always));
}

TEST_CASE("faults: a throw in any backward cell names it", "[faults]") {
  check_fault(FaultPhase::Backward, GENERATE(Checkpoint::Never, Checkpoint::Always));
}

TEST_CASE("faults: a throw in any recompute names it", "[faults]") {
  check_fault(FaultPhase::Recompute, Checkpoint::Always);
}

TEST_CASE("faults: workers parked for their input wake up when another stage fails", "[faults]") {
  // The failing stage naps 20 ms per cell: the others wait for it far
  // longer than a worker spins, so they park (forward: the stages after
  // it; backward: the stages before it), and only the failure can wake
  // them.
  const auto phase = GENERATE(FaultPhase::Forward, FaultPhase::Backward);
  const int64_t stage = phase == FaultPhase::Forward ? 0 : kStages - 1;
  CAPTURE(phase_word(phase), stage);
  auto plan = std::make_shared<FaultPlan>();
  torch::manual_seed(4);
  torch::nn::Sequential model;
  std::vector<int64_t> balance;
  for (int64_t j = 0; j < kStages; ++j) {
    if (j == stage) {
      model->push_back(
          Sleep(j, std::make_shared<gpipe_test::CellLog>(), std::chrono::milliseconds(20)));
    }
    model->push_back(gpipe_test::MarkedLinear(5, 5));
    model->push_back(gpipe_test::Thrower(j, plan));
    balance.push_back(j == stage ? 3 : 2);
  }
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance(balance).chunks(kMicrobatches));

  plan->arm(stage, 1, phase);
  const auto x = marked_input(8, 6, kMicrobatches).requires_grad_(true);
  check_cell_error(step(pipe, x), stage, 1, phase);
  check_recovered(pipe, ref, *plan);
}

TEST_CASE("faults: no cell starts once a later stage failed, even one waiting for a lock",
          "[faults]") {
  // Issue 22: stage 2 naps 150 ms per cell, stage 3 throws on its first.
  // Stage 3's first cell of the step needs the CPU generator to itself and
  // waits for stage 2's cell to let go of it; stage 2's next cell then waits
  // behind it, and finds the step failed once it gets the lock. So stage 2
  // runs micro-batch 0, and 1 at most, never 2.
  for (int attempt = 0; attempt < 3; ++attempt) {
    CAPTURE(attempt);
    auto plan = std::make_shared<FaultPlan>();
    auto log = std::make_shared<gpipe_test::CellLog>();
    torch::nn::Sequential model;
    for (int64_t j = 0; j < 4; ++j) {
      model->push_back(gpipe_test::MarkedLinear(5, 5));
      if (j == 2) model->push_back(Sleep(j, log, std::chrono::milliseconds(150)));
      if (j == 3) model->push_back(gpipe_test::Thrower(j, plan));
    }
    gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 2, 2}).chunks(5));
    plan->arm(3, 0, FaultPhase::Forward);
    const auto x = marked_input(10, 6, 5).requires_grad_(true);
    check_cell_error(step(pipe, x), 3, 0, FaultPhase::Forward);
    std::vector<int64_t> started;
    for (const auto& e : log->events()) {
      if (e.phase == 'F') started.push_back(e.microbatch);
    }
    CHECK((started == std::vector<int64_t>{0} || started == std::vector<int64_t>{0, 1}));
  }
}

TEST_CASE("faults: a shape error in a later stage names the stage", "[faults]") {
  // A c10::Error from libtorch itself, raised on stage 1 by every
  // micro-batch: the first one to fail is reported, as a CellError.
  using namespace torch::nn;
  gpipe::Pipe pipe(Sequential(Linear(4, 8), Linear(5, 2)), PipeOptions().balance({1, 1}).chunks(2));
  auto error = step(pipe, torch::randn({4, 4}));
  REQUIRE(error != nullptr);
  try {
    std::rethrow_exception(error);
  } catch (const gpipe::CellError& e) {
    CHECK(e.stage() == 1);
    CHECK(e.phase() == "forward");
    CHECK_THAT(std::string(e.what()), Contains("stage 1, micro-batch"));
    CHECK_THROWS_AS(std::rethrow_exception(e.original()), c10::Error);
  }
}

namespace {
// Throws an int: not a std::exception.
struct WeirdImpl : torch::nn::Cloneable<WeirdImpl> {
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (x.size(0) > 0) throw 42;
    return x;
  }
};
TORCH_MODULE(Weird);
}  // namespace

TEST_CASE("faults: a throw that is not a std::exception still surfaces", "[faults]") {
  gpipe::Pipe pipe(torch::nn::Sequential(torch::nn::Linear(3, 3), Weird()),
                   PipeOptions().balance({1, 1}).chunks(2));
  auto error = step(pipe, torch::randn({4, 3}));
  REQUIRE(error != nullptr);
  CHECK_THROWS_AS(std::rethrow_exception(error), gpipe::CellError);
  CHECK_THROWS_WITH(std::rethrow_exception(error), Contains("stage 1"));
}

TEST_CASE("faults: destroying a Pipe right after a failure returns promptly", "[faults]") {
  const auto phase = GENERATE(FaultPhase::Forward, FaultPhase::Backward, FaultPhase::Recompute);
  const bool keep_output = GENERATE(false, true);
  CAPTURE(phase_word(phase), keep_output);
  auto plan = std::make_shared<FaultPlan>();
  auto pipe = faulty_pipe(faulty_model(plan), Checkpoint::Always);
  plan->arm(1, 2, phase);
  const auto x = marked_input(8, 6, kMicrobatches).requires_grad_(true);

  const double seconds = gpipe_test::seconds_to_drop_after_failure(pipe, x, keep_output);
  CHECK(pipe.is_empty());
  CHECK(seconds < 5.0);
}

TEST_CASE("faults: a failed call leaves no stale micro-batches behind", "[faults]") {
  // Fail in forward at the last micro-batch of the last stage while the
  // other cells have produced outputs; then run clean calls with a
  // different batch size: nothing from the failed run may leak in.
  auto plan = std::make_shared<FaultPlan>();
  auto model = faulty_model(plan);
  auto ref = deep_copy(model);
  auto pipe = faulty_pipe(model, Checkpoint::ExceptLast);
  plan->arm(kStages - 1, kMicrobatches - 1, FaultPhase::Forward);
  check_cell_error(step(pipe, marked_input(8, 6, kMicrobatches)), kStages - 1, kMicrobatches - 1,
                   FaultPhase::Forward);
  plan->disarm();
  const auto x = marked_input(5, 6, kMicrobatches);
  torch::NoGradGuard no_grad;
  for (int i = 0; i < 3; ++i) CHECK(max_abs_diff(pipe->forward(x), ref->forward(x)) <= kTolerance);
}
