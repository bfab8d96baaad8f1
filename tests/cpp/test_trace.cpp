// test_trace.cpp — tracing records every cell in schedule order, off by default, in a bounded window; Chrome JSON and the bubble summary.
#include "models.h"
#include "trace.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe::TraceEvent;
using gpipe::TracePhase;

namespace {

torch::nn::Sequential mlp(int64_t layers) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(6, 6));
  return model;
}

void train_step(gpipe::Pipe& pipe, int64_t rows) {
  auto x = torch::randn({rows, 6}, torch::dtype(torch::kFloat64));
  pipe->forward(x).pow(2).sum().backward();
}

std::vector<TraceEvent> of(const std::vector<TraceEvent>& events, int64_t stage) {
  std::vector<TraceEvent> out;
  for (const auto& e : events) {
    if (e.stage == stage) out.push_back(e);
  }
  std::sort(out.begin(), out.end(),
            [](const TraceEvent& a, const TraceEvent& b) { return a.start_us < b.start_us; });
  return out;
}

size_t count(const std::string& text, const std::string& word) {
  size_t n = 0;
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("trace: off by default, nothing recorded", "[trace]") {
  auto model = mlp(3);
  model->to(torch::kFloat64);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1}).chunks(4));
  CHECK_FALSE(pipe->tracing());
  train_step(pipe, 8);
  CHECK(pipe->trace().events.empty());
}

TEST_CASE("trace: every cell of a step, in schedule order, on its stage's thread", "[trace]") {
  constexpr int64_t kStages = 3;
  constexpr int64_t kChunks = 4;
  auto model = mlp(kStages);
  model->to(torch::kFloat64);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1, 1}).chunks(kChunks).trace(true));
  REQUIRE(pipe->tracing());
  train_step(pipe, 8);
  const auto events = pipe->trace().events;

  // ExceptLast: every micro-batch but the last is recomputed on every stage.
  std::map<TracePhase, int64_t> per_phase;
  for (const auto& e : events) {
    ++per_phase[e.phase];
    CHECK(e.step == 0);
    CHECK(e.end_us >= e.start_us);
  }
  CHECK(per_phase[TracePhase::Forward] == kStages * kChunks);
  CHECK(per_phase[TracePhase::Backward] == kStages * kChunks);
  CHECK(per_phase[TracePhase::Recompute] == kStages * (kChunks - 1));
  CHECK(per_phase[TracePhase::Copy] == 0);  // CPU to CPU moves nothing

  std::set<int64_t> forward_threads;
  for (int64_t j = 0; j < kStages; ++j) {
    const auto stage = of(events, j);
    std::vector<std::string> order;
    for (const auto& e : stage) {
      std::ostringstream name;
      name << "FBRC"[static_cast<int>(e.phase)] << e.microbatch;
      order.push_back(name.str());
    }
    CHECK(order == std::vector<std::string>{"F0", "F1", "F2", "F3", "B3", "R2", "B2", "R1", "B1",
                                            "R0", "B0"});
    std::set<int64_t> threads;
    for (const auto& e : stage) {
      if (e.phase == TracePhase::Forward) threads.insert(e.thread);
    }
    CHECK(threads.size() == 1);
    forward_threads.insert(*threads.begin());
  }
  CHECK(forward_threads.size() == kStages);  // one worker per stage

  // Dependencies: F(i) on stage j starts after F(i) on stage j-1 ends; B(i)
  // (with its recompute) on stage j after B(i) on stage j+1.
  auto find = [&](int64_t stage, int64_t mb, TracePhase phase) {
    for (const auto& e : events) {
      if (e.stage == stage && e.microbatch == mb && e.phase == phase) return e;
    }
    FAIL("no event for stage " << stage << " micro-batch " << mb);
    return TraceEvent{};
  };
  for (int64_t i = 0; i < kChunks; ++i) {
    for (int64_t j = 1; j < kStages; ++j) {
      CHECK(find(j, i, TracePhase::Forward).start_us >= find(j - 1, i, TracePhase::Forward).end_us);
      CHECK(find(j - 1, i, TracePhase::Backward).start_us >=
            find(j, i, TracePhase::Backward).end_us);
    }
  }
}

TEST_CASE("trace: steps are numbered, clear_trace starts over, tracing switches off", "[trace]") {
  auto model = mlp(2);
  model->to(torch::kFloat64);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(2).checkpoint(Checkpoint::Never));
  pipe->set_tracing(true);
  train_step(pipe, 4);
  train_step(pipe, 4);
  std::set<int64_t> steps;
  for (const auto& e : pipe->trace().events) steps.insert(e.step);
  CHECK(steps == std::set<int64_t>{0, 1});
  CHECK(pipe->trace().events.size() == 2 * 2 * 2 * 2);

  pipe->clear_trace();
  CHECK(pipe->trace().events.empty());
  train_step(pipe, 4);
  for (const auto& e : pipe->trace().events) CHECK(e.step == 0);

  pipe->set_tracing(false);
  pipe->clear_trace();
  train_step(pipe, 4);
  CHECK(pipe->trace().events.empty());
}

TEST_CASE("trace: Chrome JSON has a row per stage and a box per event", "[trace]") {
  auto model = mlp(2);
  model->to(torch::kFloat64);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(3).trace(true));
  train_step(pipe, 6);
  const auto trace = pipe->trace();
  const std::string json = trace.to_chrome_json();
  CHECK(json.rfind("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", 0) == 0);
  CHECK(count(json, "\"ph\":\"X\"") == trace.events.size());
  CHECK(count(json, "\"name\":\"thread_name\"") == 2);
  CHECK(count(json, "\"name\":\"F2\"") == 2);
  CHECK(count(json, "\"name\":\"R0\"") == 2);
  CHECK(count(json, "\"cat\":\"recompute\"") == 2 * 2);

  const std::string path = "gpipe_test_trace.json";
  trace.save_chrome_json(path);
  std::ifstream file(path);
  std::stringstream read;
  read << file.rdbuf();
  CHECK(read.str() == json);
  std::remove(path.c_str());
  CHECK_THROWS_WITH(trace.save_chrome_json("/nonexistent-dir/trace.json"),
                    Catch::Contains("/nonexistent-dir/trace.json"));
}

TEST_CASE("trace: the measured bubble of sleeping stages is near GPipe's", "[trace]") {
  constexpr int64_t kStages = 3;
  constexpr int64_t kChunks = 6;
  auto log = std::make_shared<gpipe_test::CellLog>();
  torch::nn::Sequential model;
  for (int64_t j = 0; j < kStages; ++j) {
    model->push_back(gpipe_test::Sleep(j, log, std::chrono::milliseconds(10)));
  }
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({1, 1, 1})
                              .chunks(kChunks)
                              .checkpoint(Checkpoint::Never)
                              .trace(true));
  auto x = gpipe_test::marked_input(kChunks, 4, kChunks).requires_grad_();
  pipe->forward(x).sum().backward();
  const auto s = pipe->trace().summary();
  CHECK(s.stages == kStages);
  CHECK(s.microbatches == kChunks);
  CHECK(s.steps == 1);
  CHECK(s.ideal_bubble == Approx(2.0 / 8.0));
  REQUIRE(s.busy_us.size() == kStages);
  for (double busy : s.busy_us) CHECK(busy >= 2 * kChunks * 10'000 * 0.95);
  // Sleeps only get longer: the bubble can't fall below the ideal by more
  // than noise; generous above (a shared machine).
  CHECK(s.bubble > s.ideal_bubble - 0.05);
  CHECK(s.bubble < s.ideal_bubble + 0.25);
  const std::string text = s.to_string();
  CHECK_THAT(text, Catch::Contains("bubble") && Catch::Contains("stage 2: busy"));
}

namespace {

// Records one host-timed event of `step` now.
void record(gpipe::detail::Tracer& tracer, int64_t step, TracePhase phase = TracePhase::Forward) {
  const auto now = gpipe::detail::Tracer::Clock::now();
  tracer.record(step, 0, 0, phase, now, now);
}

std::vector<int64_t> steps_of(const gpipe::Trace& trace) {
  std::vector<int64_t> steps;
  for (const auto& e : trace.events) steps.push_back(e.step);
  return steps;
}

}  // namespace

TEST_CASE("trace: the window keeps whole steps, newest first, and counts what it drops", "[trace]") {
  gpipe::detail::Tracer tracer;
  CHECK(tracer.capacity() == gpipe::kDefaultTraceCapacity);
  tracer.set_capacity(4);
  record(tracer, 0);
  record(tracer, 0);
  record(tracer, 1);
  record(tracer, 1);
  CHECK(steps_of(tracer.snapshot()) == std::vector<int64_t>{0, 0, 1, 1});
  CHECK(tracer.snapshot().dropped == 0);
  record(tracer, 1, TracePhase::Backward);  // 5 events: step 0 goes, whole
  CHECK(steps_of(tracer.snapshot()) == std::vector<int64_t>{1, 1, 1});
  CHECK(tracer.snapshot().dropped == 2);
  record(tracer, 0, TracePhase::Backward);  // late, for a dropped step: dropped too
  CHECK(steps_of(tracer.snapshot()) == std::vector<int64_t>{1, 1, 1});
  CHECK(tracer.snapshot().dropped == 3);

  SECTION("steps that interleave are dropped whole all the same") {
    record(tracer, 2);
    record(tracer, 1, TracePhase::Backward);  // 5 events: step 1 goes, around step 2's
    CHECK(steps_of(tracer.snapshot()) == std::vector<int64_t>{2});
    CHECK(tracer.snapshot().dropped == 3 + 4);
  }
  SECTION("a step alone over the capacity keeps its newest events") {
    tracer.set_capacity(2);  // trims at once
    CHECK(steps_of(tracer.snapshot()) == std::vector<int64_t>{1, 1});
    CHECK(tracer.snapshot().dropped == 4);
    CHECK(tracer.snapshot().events.back().phase == TracePhase::Backward);
  }
  SECTION("clear starts over") {
    tracer.clear();
    CHECK(tracer.snapshot().events.empty());
    CHECK(tracer.snapshot().dropped == 0);
    record(tracer, 0);
    CHECK(steps_of(tracer.snapshot()) == std::vector<int64_t>{0});
  }
  CHECK_THROWS_AS(tracer.set_capacity(0), c10::ValueError);
  CHECK_THROWS_WITH(tracer.set_capacity(-3), Catch::Contains("got -3"));
}

TEST_CASE("trace: a long run stays within the capacity and keeps the newest steps", "[trace]") {
  // 2 stages x 2 micro-batches x (forward, backward): 8 events per step.
  constexpr int64_t kPerStep = 8;
  constexpr int64_t kSteps = 40;
  auto model = mlp(2);
  model->to(torch::kFloat64);
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({1, 1})
                              .chunks(2)
                              .checkpoint(Checkpoint::Never)
                              .trace(true)
                              .trace_capacity(20));
  for (int64_t step = 0; step < kSteps; ++step) train_step(pipe, 4);
  const auto trace = pipe->trace();
  // The newest whole steps that fit in 20 events: 2 of them.
  CHECK(trace.events.size() == 2 * kPerStep);
  CHECK(trace.dropped == (kSteps - 2) * kPerStep);
  std::set<int64_t> steps;
  for (const auto& e : trace.events) steps.insert(e.step);
  CHECK(steps == std::set<int64_t>{kSteps - 2, kSteps - 1});
  const auto summary = trace.summary();
  CHECK(summary.steps == 2);
  CHECK(summary.microbatches == 2);
  CHECK(summary.stages == 2);

  CHECK(PipeOptions().trace_capacity() == gpipe::kDefaultTraceCapacity);
  CHECK_THROWS_WITH(gpipe::Pipe(mlp(2), PipeOptions().balance({2}).trace_capacity(0)),
                    Catch::Contains("trace capacity must be at least 1 event, got 0"));
}

TEST_CASE("trace: sends and receives are named, keep their peer, and are not busy time",
          "[trace]") {
  using Clock = gpipe::detail::Tracer::Clock;
  gpipe::detail::Tracer tracer;
  tracer.enable(true);
  const auto t0 = Clock::now();
  const auto ms = [&](int n) { return t0 + std::chrono::milliseconds(n); };
  // Stage 1 waits 2 ms for stage 0's activation, runs 3 ms, sends 1 ms to stage 2.
  tracer.record(0, 1, 0, TracePhase::Receive, ms(0), ms(2), /*peer=*/0);
  tracer.record(0, 1, 0, TracePhase::Forward, ms(2), ms(5));
  tracer.record(0, 1, 0, TracePhase::Send, ms(5), ms(6), /*peer=*/2);
  const auto trace = tracer.snapshot();
  REQUIRE(trace.events.size() == 3);
  CHECK(trace.events[0].peer == 0);
  CHECK(trace.events[1].peer == -1);
  CHECK(trace.events[2].peer == 2);
  CHECK(std::string(gpipe::to_string(TracePhase::Send)) == "send");
  CHECK(std::string(gpipe::to_string(TracePhase::Receive)) == "receive");

  const auto s = trace.summary();
  REQUIRE(s.busy_us.size() == 2);
  CHECK(s.busy_us[1] == Approx(3000.0));
  CHECK(s.span_us == Approx(3000.0));  // the forward alone: hand-offs are no span
  CHECK(s.steps == 1);

  const std::string json = trace.to_chrome_json();
  CHECK(count(json, "\"name\":\"Rx0\",\"cat\":\"receive\"") == 1);
  CHECK(count(json, "\"name\":\"Tx0\",\"cat\":\"send\"") == 1);
  CHECK(count(json, "\"peer\":2") == 1);
  CHECK(count(json, "\"peer\":") == 2);
}
