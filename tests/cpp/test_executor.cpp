// test_executor.cpp — the executor's workers and the stages it runs on the calling thread (the CUDA deadlock rule's split).
#include "engine.h"
#include "executor.h"

#include <gpipe/error.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using gpipe::detail::Action;
using gpipe::detail::Batch;
using gpipe::detail::CellFn;
using gpipe::detail::Executor;
using gpipe::detail::Payload;

namespace {

struct Seen {
  std::mutex mutex;
  std::vector<std::set<std::thread::id>> threads;
  std::vector<int64_t> stage_in_cell;
};

// A cell that adds 1 and notes which thread ran it.
CellFn counting_cell(Seen& seen) {
  return [&seen](int64_t stage, const Action& /*action*/, Payload in, const char*& /*phase*/) {
    std::lock_guard<std::mutex> hold(seen.mutex);
    seen.threads[static_cast<size_t>(stage)].insert(std::this_thread::get_id());
    seen.stage_in_cell.push_back(Executor::current_stage() == stage ? 1 : 0);
    return Payload{Batch(in.batch[0] + 1), {}};
  };
}

std::vector<Payload> zeros(int64_t microbatches) {
  std::vector<Payload> sources;
  for (int64_t i = 0; i < microbatches; ++i) sources.push_back(Payload{Batch(torch::zeros({1})), {}});
  return sources;
}

}  // namespace

TEST_CASE("the executor runs the marked stages on the calling thread and the rest on workers") {
  constexpr int64_t kStages = 3;
  constexpr int64_t kMicrobatches = 4;
  Executor executor(kStages);
  for (const auto& schedule : {gpipe::detail::gpipe_forward(kStages, kMicrobatches),
                               gpipe::detail::gpipe_backward(kStages, kMicrobatches)}) {
    const std::vector<bool> marked = GENERATE(std::vector<bool>{false, true, false},
                                              std::vector<bool>{true, false, true},
                                              std::vector<bool>{true, true, true});
    Seen seen;
    seen.threads.resize(kStages);
    const at::ThreadLocalState state;
    auto sinks = executor.run(schedule, zeros(kMicrobatches), counting_cell(seen), state, marked);
    REQUIRE(sinks.size() == kMicrobatches);
    for (auto& s : sinks) CHECK(s.batch[0].item<double>() == kStages);
    const auto me = std::this_thread::get_id();
    for (int64_t j = 0; j < kStages; ++j) {
      INFO("stage " << j);
      REQUIRE(seen.threads[j].size() == 1);
      CHECK((*seen.threads[j].begin() == me) == marked[j]);
    }
    for (auto flag : seen.stage_in_cell) CHECK(flag == 1);
    CHECK(Executor::current_stage() == -1);
  }
}

namespace {

using gpipe::detail::Address;
using gpipe::detail::Flow;
using gpipe::detail::Mailboxes;
using gpipe::detail::Op;
using gpipe::detail::Plan;
using gpipe::detail::Task;

// A task that hands a counter along the plan's edges (F to the next stage,
// B back to the previous) and logs the order each worker ran its tasks in.
struct PlanLog {
  std::mutex mutex;
  std::vector<std::vector<Task>> ran;
  std::vector<double> grads;  // what B of stage 0 received, per micro-batch
};

gpipe::detail::TaskFn passing_task(const Plan& plan, Mailboxes& mail, PlanLog& log) {
  return [&plan, &mail, &log](const Task& t, const char*& /*phase*/) {
    const int64_t last = plan.stages - 1;
    double value = 0;
    if (t.op == Op::F && t.stage > 0) {
      auto in = mail.receive({t.stage, Flow::Activation, t.microbatch});
      if (!in) return;
      value = in->batch[0].item<double>();
    } else if ((t.op == Op::B || t.op == Op::I) && t.stage < last) {
      auto in = mail.receive({t.stage, Flow::Grad, t.microbatch});
      if (!in) return;
      value = in->batch[0].item<double>();
    }
    {
      std::lock_guard<std::mutex> hold(log.mutex);
      log.ran[static_cast<size_t>(plan.worker_of(t.stage))].push_back(t);
    }
    if (t.op == Op::F && t.stage < last) {
      mail.send({t.stage + 1, Flow::Activation, t.microbatch},
                Payload{Batch(torch::full({1}, value + 1)), {}});
    } else if ((t.op == Op::B || t.op == Op::I) && t.stage > 0) {
      mail.send({t.stage - 1, Flow::Grad, t.microbatch},
                Payload{Batch(torch::full({1}, value + 1)), {}});
    } else if (t.op == Op::B || t.op == Op::I) {
      std::lock_guard<std::mutex> hold(log.mutex);
      log.grads[static_cast<size_t>(t.microbatch)] = value;
    }
  };
}

}  // namespace

TEST_CASE("executor: runs any valid plan, each worker's list in its order", "[executor]") {
  // Not a generated schedule: worker 0 runs both forwards, then the
  // backwards in the "wrong" order; worker 1 interleaves.
  Plan plan;
  plan.workers = 2;
  plan.stages = 2;
  plan.microbatches = 2;
  plan.lists = {{{Op::F, 0, 0}, {Op::F, 0, 1}, {Op::B, 0, 1}, {Op::I, 0, 0}, {Op::W, 0, 0}},
                {{Op::F, 1, 0}, {Op::B, 1, 0}, {Op::F, 1, 1}, {Op::I, 1, 1}, {Op::W, 1, 1}}};
  gpipe::detail::validate(plan);
  Executor executor(2);
  Mailboxes mail(2, 2);
  PlanLog log;
  log.ran.resize(2);
  log.grads.assign(2, -1);
  executor.run_plan(plan, passing_task(plan, mail, log), mail, at::ThreadLocalState());
  CHECK(log.ran == plan.lists);
  CHECK(log.grads == std::vector<double>{1, 1});  // one hop back from the last stage
}

TEST_CASE("executor: a task that throws cancels a plan's run without a hang", "[executor]") {
  const auto plan = gpipe::detail::one_f_one_b_plan(3, 4);
  Executor executor(3);
  for (int64_t worker = 0; worker < 3; ++worker) {
    Mailboxes mail(3, 4);
    PlanLog log;
    log.ran.resize(3);
    log.grads.assign(4, -1);
    auto pass = passing_task(plan, mail, log);
    const gpipe::detail::TaskFn failing = [&](const Task& t, const char*& phase) {
      if (plan.worker_of(t.stage) == worker && t.op == Op::B && t.microbatch == 1) {
        phase = "loss";
        throw std::runtime_error("task boom");
      }
      pass(t, phase);
    };
    try {
      executor.run_plan(plan, failing, mail, at::ThreadLocalState());
      FAIL("no error");
    } catch (const gpipe::CellError& e) {
      CHECK(e.stage() == worker);
      CHECK(e.microbatch() == 1);
      CHECK(e.phase() == "loss");
      CHECK(std::string(e.what()).find("task boom") != std::string::npos);
    }
    CHECK(mail.cancelled());
  }
}

TEST_CASE("the deadlock rule: stages on the thread's device, or whose graphs reach it, run inline",
          "[executor]") {
  using gpipe::detail::stages_inline_on;
  const c10::Device cpu(c10::kCPU), gpu0(c10::kCUDA, 0), gpu1(c10::kCUDA, 1);
  // CPU -> cuda:0 -> cuda:1 -> cuda:0, PipeBackward on cuda:0's engine thread.
  const std::vector<c10::Device> stages{cpu, gpu0, gpu1, gpu0};
  const std::vector<std::vector<c10::Device>> none(4);
  CHECK(stages_inline_on(0, stages, none) == std::vector<bool>{false, true, false, true});
  CHECK(stages_inline_on(1, stages, none) == std::vector<bool>{false, false, true, false});
  // The CPU stage closes over a tensor on cuda:0, the cuda:1 stage moved a
  // buffer to cuda:1 only: the first joins cuda:0's thread, the second
  // needs none but its own.
  const std::vector<std::vector<c10::Device>> reached{{gpu0}, {}, {gpu1}, {}};
  CHECK(stages_inline_on(0, stages, reached) == std::vector<bool>{true, true, false, true});
  CHECK(stages_inline_on(1, stages, reached) == std::vector<bool>{false, false, true, false});
}
