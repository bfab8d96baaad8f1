// test_pipe_concurrency.cpp — stages really run at once, in GPipe order, one thread each; layers see their phase.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <vector>

using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::CellEvent;
using gpipe_test::CellLog;
using gpipe_test::Clock;
using gpipe_test::marked_input;
using gpipe_test::Probe;
using gpipe_test::ProbeLog;
using gpipe_test::ProbeRecord;
using gpipe_test::Sleep;

namespace {

constexpr int64_t kStages = 3;
constexpr int64_t kMicrobatches = 4;

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

bool overlap(const CellEvent& a, const CellEvent& b) { return a.start < b.end && b.start < a.end; }

// Events of one phase, as [stage][microbatch].
std::vector<std::vector<CellEvent>> by_cell(const std::vector<CellEvent>& events, char phase) {
  std::vector<std::vector<CellEvent>> cells(kStages, std::vector<CellEvent>(kMicrobatches));
  std::vector<std::vector<int>> seen(kStages, std::vector<int>(kMicrobatches, 0));
  for (const auto& e : events) {
    if (e.phase != phase) continue;
    REQUIRE(e.stage >= 0);
    REQUIRE(e.stage < kStages);
    REQUIRE(e.microbatch >= 0);
    REQUIRE(e.microbatch < kMicrobatches);
    cells[e.stage][e.microbatch] = e;
    ++seen[e.stage][e.microbatch];
  }
  for (int64_t j = 0; j < kStages; ++j) {
    for (int64_t i = 0; i < kMicrobatches; ++i) {
      INFO(phase << " stage " << j << " micro-batch " << i);
      REQUIRE(seen[j][i] == 1);  // every cell ran exactly once
    }
  }
  return cells;
}

// The micro-batches of one stage and phase, in the order they started.
std::vector<int64_t> order_on_stage(const std::vector<CellEvent>& events, char phase,
                                    int64_t stage) {
  std::vector<CellEvent> mine;
  for (const auto& e : events) {
    if (e.phase == phase && e.stage == stage) mine.push_back(e);
  }
  std::sort(mine.begin(), mine.end(),
            [](const CellEvent& a, const CellEvent& b) { return a.start < b.start; });
  std::vector<int64_t> order;
  for (const auto& e : mine) order.push_back(e.microbatch);
  return order;
}

bool stages_overlap(const std::vector<CellEvent>& events, char phase) {
  for (const auto& a : events) {
    for (const auto& b : events) {
      if (a.phase == phase && b.phase == phase && a.stage != b.stage && overlap(a, b)) return true;
    }
  }
  return false;
}

double serial_ms(const std::vector<CellEvent>& events, char phase) {
  double sum = 0;
  for (const auto& e : events) {
    if (e.phase == phase) sum += ms(e.end - e.start);
  }
  return sum;
}

}  // namespace

TEST_CASE("concurrency: stages overlap and follow the GPipe schedule", "[concurrency]") {
  auto log = std::make_shared<CellLog>();
  torch::nn::Sequential model;
  for (int64_t j = 0; j < kStages; ++j) model->push_back(Sleep(j, log, std::chrono::milliseconds(20)));
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1}).chunks(kMicrobatches).checkpoint(Checkpoint::Never));
  // 8 rows: micro-batch i is rows 2i, 2i+1, both holding i in column 0.
  auto x = marked_input(8, 3, kMicrobatches).requires_grad_(true);

  const auto t0 = Clock::now();
  auto y = pipe->forward(x);
  const auto t1 = Clock::now();
  y.sum().backward();
  const auto t2 = Clock::now();

  // The layers are identities: the result is still right.
  CHECK(torch::equal(y.detach(), x.detach()));
  CHECK(torch::equal(x.grad(), torch::ones_like(x)));

  const auto events = log->events();
  REQUIRE(events.size() == 2 * kStages * kMicrobatches);
  const auto fwd = by_cell(events, 'F');
  const auto bwd = by_cell(events, 'B');

  // (a), (b): cells of different stages run at the same time.
  CHECK(stages_overlap(events, 'F'));
  CHECK(stages_overlap(events, 'B'));
  // Generous: ideal is (M + K - 1) / (M K) = 0.5 of the serial time.
  INFO("forward " << ms(t1 - t0) << " ms of " << serial_ms(events, 'F') << " ms serial; backward "
                  << ms(t2 - t1) << " ms of " << serial_ms(events, 'B') << " ms serial");
  CHECK(ms(t1 - t0) < 0.8 * serial_ms(events, 'F'));
  CHECK(ms(t2 - t1) < 0.8 * serial_ms(events, 'B'));

  // (c): GPipe order. Forward 0,1,2,3 and backward 3,2,1,0 on every stage;
  // a cell starts only after the cell it depends on has ended.
  for (int64_t j = 0; j < kStages; ++j) {
    CAPTURE(j);
    CHECK(order_on_stage(events, 'F', j) == std::vector<int64_t>{0, 1, 2, 3});
    CHECK(order_on_stage(events, 'B', j) == std::vector<int64_t>{3, 2, 1, 0});
    for (int64_t i = 0; i < kMicrobatches; ++i) {
      CAPTURE(i);
      if (j > 0) CHECK(fwd[j][i].start >= fwd[j - 1][i].end);
      if (j + 1 < kStages) CHECK(bwd[j][i].start >= bwd[j + 1][i].end);
    }
  }

  // (d): one thread per stage, forward and backward alike, none shared, none
  // the caller's.
  std::set<std::thread::id> threads;
  for (int64_t j = 0; j < kStages; ++j) {
    std::set<std::thread::id> mine;
    for (const auto& e : events) {
      if (e.stage == j) mine.insert(e.thread);
    }
    CAPTURE(j);
    CHECK(mine.size() == 1);
    threads.insert(mine.begin(), mine.end());
  }
  CHECK(threads.size() == static_cast<size_t>(kStages));
  CHECK(threads.count(std::this_thread::get_id()) == 0);
}

TEST_CASE("concurrency: workers persist across calls", "[concurrency]") {
  // The same stage runs on the same thread in the next forward call.
  auto log = std::make_shared<CellLog>();
  torch::nn::Sequential model;
  for (int64_t j = 0; j < kStages; ++j) model->push_back(Sleep(j, log, std::chrono::milliseconds(0)));
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1}).chunks(kMicrobatches));
  torch::NoGradGuard no_grad;
  pipe->forward(marked_input(4, 2, kMicrobatches));
  pipe->forward(marked_input(4, 2, kMicrobatches));
  const auto events = log->events();
  REQUIRE(events.size() == 2 * kStages * kMicrobatches);
  std::map<int64_t, std::set<std::thread::id>> threads;
  for (const auto& e : events) threads[e.stage].insert(e.thread);
  for (const auto& [stage, ids] : threads) {
    CAPTURE(stage);
    CHECK(ids.size() == 1);
  }
}

namespace {

// Runs forward then backward through Probe layers on 2 stages, 4
// micro-batches, and returns what the probes saw in each half.
struct Seen {
  std::vector<ProbeRecord> forward;
  std::vector<ProbeRecord> backward;
};

Seen probe_run(Checkpoint mode, bool eval, bool no_grad) {
  auto log = std::make_shared<ProbeLog>();
  torch::nn::Sequential model(Probe(0, log), Probe(1, log));
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(4).checkpoint(mode));
  if (eval) pipe->eval();
  // Probes double their input: the marker doubles once per stage, so
  // stage 1 reads 2i. Give stage 0 the marker i, undo at stage 1 below.
  auto x = marked_input(8, 2, 4).requires_grad_(true);
  Seen seen;
  torch::Tensor y;
  {
    std::optional<torch::NoGradGuard> guard;
    if (no_grad) guard.emplace();
    y = pipe->forward(x);
  }
  seen.forward = log->take();
  if (y.requires_grad()) y.sum().backward();
  seen.backward = log->take();
  for (auto* records : {&seen.forward, &seen.backward}) {
    for (auto& r : *records) {
      if (r.stage == 1) r.microbatch /= 2;
    }
  }
  CHECK_FALSE(gpipe::is_checkpointing());
  CHECK_FALSE(gpipe::is_recomputing());
  return seen;
}

}  // namespace

TEST_CASE("concurrency: layers see whether they are checkpointing or recomputing", "[concurrency][phase]") {
  SECTION("checkpoint always: every first forward checkpoints, every backward recomputes") {
    const auto seen = probe_run(Checkpoint::Always, false, false);
    REQUIRE(seen.forward.size() == 8);
    for (const auto& r : seen.forward) {
      CHECK(r.checkpointing);
      CHECK_FALSE(r.recomputing);
    }
    REQUIRE(seen.backward.size() == 8);
    for (const auto& r : seen.backward) {
      CHECK(r.recomputing);
      CHECK_FALSE(r.checkpointing);
    }
  }
  SECTION("checkpoint except_last: the last micro-batch is plain and not recomputed") {
    const auto seen = probe_run(Checkpoint::ExceptLast, false, false);
    REQUIRE(seen.forward.size() == 8);
    for (const auto& r : seen.forward) {
      CAPTURE(r.stage, r.microbatch);
      CHECK(r.checkpointing == (r.microbatch != 3));
      CHECK_FALSE(r.recomputing);
    }
    REQUIRE(seen.backward.size() == 6);
    for (const auto& r : seen.backward) {
      CAPTURE(r.stage, r.microbatch);
      CHECK(r.microbatch != 3);
      CHECK(r.recomputing);
      CHECK_FALSE(r.checkpointing);
    }
  }
  SECTION("checkpoint never, eval mode, and no-grad: never either") {
    const Seen runs[] = {probe_run(Checkpoint::Never, false, false),
                         probe_run(Checkpoint::Always, true, false),
                         probe_run(Checkpoint::Always, false, true)};
    for (const auto& seen : runs) {
      REQUIRE(seen.forward.size() == 8);
      for (const auto& r : seen.forward) {
        CHECK_FALSE(r.checkpointing);
        CHECK_FALSE(r.recomputing);
      }
      CHECK(seen.backward.empty());
    }
  }
  SECTION("a plain Sequential: never either") {
    auto log = std::make_shared<ProbeLog>();
    torch::nn::Sequential model(Probe(0, log), Probe(1, log));
    auto x = marked_input(8, 2, 4).requires_grad_(true);
    model->forward(x).sum().backward();
    const auto records = log->take();
    REQUIRE(records.size() == 2);
    for (const auto& r : records) {
      CHECK_FALSE(r.checkpointing);
      CHECK_FALSE(r.recomputing);
    }
  }
}

TEST_CASE("concurrency: many back-to-back runs stay transparent", "[concurrency]") {
  // Races between workers, mailboxes and the autograd engine would show as
  // an occasional wrong grad: repeat a 4-stage, 8-micro-batch run.
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  auto model = gpipe_test::inplace_mlp();
  auto ref = gpipe_test::deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2, 1, 2}).chunks(8).checkpoint(mode));
  const auto x = gpipe_test::randn64({16, 4});
  ref->forward(x).pow(2).sum().backward();
  for (int iteration = 0; iteration < 30; ++iteration) {
    CAPTURE(iteration);
    gpipe_test::zero_grads(*pipe);
    pipe->forward(x).pow(2).sum().backward();
    gpipe_test::check_param_grads(*pipe, *ref);
  }
}

namespace {

/// Runs another Pipe inside its forward: a Pipe nested in a Pipe's layer.
class NestedPipeImpl : public torch::nn::Cloneable<NestedPipeImpl> {
 public:
  explicit NestedPipeImpl(gpipe::Pipe inner) : inner_(std::move(inner)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return inner_->forward(x); }

 private:
  gpipe::Pipe inner_;
};
TORCH_MODULE(NestedPipe);

}  // namespace

TEST_CASE("concurrency: one Pipe called from several threads at once serves them one by one",
          "[concurrency]") {
  const bool grad = GENERATE(false, true);
  INFO((grad ? "training steps" : "inference under NoGradGuard"));
  auto model = gpipe_test::inplace_mlp(4);
  auto ref = gpipe_test::deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2, 2}).chunks(3));
  constexpr int kThreads = 4;
  constexpr int kCalls = 10;
  std::vector<torch::Tensor> inputs;
  for (int t = 0; t < kThreads; ++t) inputs.push_back(gpipe_test::randn64({6, 4}));
  std::vector<double> worst(kThreads, 0.0);
  gpipe_test::within_deadline([&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::optional<torch::NoGradGuard> no_grad;
        if (!grad) no_grad.emplace();
        for (int c = 0; c < kCalls; ++c) {
          auto out = pipe->forward(inputs[t]);
          if (grad) out.sum().backward();
          worst[t] = std::max(worst[t], gpipe_test::max_abs_diff(out, ref->forward(inputs[t])));
        }
      });
    }
    for (auto& th : threads) th.join();
    return 0;
  });
  for (int t = 0; t < kThreads; ++t) CHECK(worst[t] <= gpipe_test::kTolerance);
  if (grad) {
    // Every thread's backward landed: the grads are the sum of all steps.
    gpipe_test::zero_grads(*ref);
    for (int t = 0; t < kThreads; ++t) {
      for (int c = 0; c < kCalls; ++c) ref->forward(inputs[t]).sum().backward();
    }
    gpipe_test::check_param_grads(*pipe, *ref);
  }
}

TEST_CASE("concurrency: a Pipe inside another Pipe's layer is refused at once", "[concurrency]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  gpipe::Pipe inner(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4)),
                    PipeOptions().balance({1, 1}).chunks(2).checkpoint(mode));
  gpipe::Pipe outer(torch::nn::Sequential(torch::nn::Linear(4, 4), NestedPipe(inner)),
                    PipeOptions().balance({1, 1}).chunks(2).checkpoint(mode));
  auto x = torch::randn({4, 4});
  gpipe_test::within_deadline([&] {
    CHECK_THROWS_WITH(outer->forward(x), Catch::Contains("inside a layer of a Pipe"));
    return 0;
  });
  // Both still work on their own.
  CHECK_NOTHROW(inner->forward(x).sum().backward());
}
