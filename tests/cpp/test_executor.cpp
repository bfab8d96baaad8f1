// test_executor.cpp — the executor's workers and the stages it runs on the calling thread (the CUDA deadlock rule's split).
#include "executor.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <mutex>
#include <set>
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
