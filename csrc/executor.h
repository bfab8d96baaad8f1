// executor.h — one worker thread per stage running a schedule, handing data between neighbours.
//
// A run gives each stage's worker its list of actions. An action waits for
// its input from the neighbouring stage (forward from j-1, backward from
// j+1; the ends are fed by `sources` and drain into the result), runs the
// cell, and hands its output on. The first cell that throws cancels the run:
// no new cell starts, every waiting worker wakes up and stops, and `run`
// rethrows that error as a CellError naming stage, micro-batch and phase
// once all workers are idle again.
#pragma once

#include "schedule.h"
#include "streams.h"

#include <ATen/ThreadLocalState.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace gpipe::detail {

/// Runs one cell: `input` is what the neighbour handed over (not yet moved
/// to this stage's device); returns what goes on. May set `phase` to name
/// the part that is running ("recompute") for error messages.
using CellFn =
    std::function<Payload(int64_t stage, const Action& action, Payload input, const char*& phase)>;

class Executor {
 public:
  /// Starts one worker per stage. `intra_op_threads[j]` > 0 fixes worker
  /// j's intra-op thread count (as `at::set_num_threads` on that thread);
  /// 0, or no entry, leaves it at torch's setting. Other threads' counts
  /// stay as they were (see executor.cpp).
  explicit Executor(int64_t stages, const std::vector<int>& intra_op_threads = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  int64_t stages() const noexcept { return static_cast<int64_t>(workers_.size()); }

  /// Runs `schedule` and returns, per micro-batch, what left the pipeline
  /// (the last stage's forward outputs, or the first stage's input grads).
  /// Workers run with `state` as their thread-local state. The calling
  /// thread runs the cells of the stages marked in `inline_stages` itself,
  /// in `serialize(schedule)` order, while the workers run the others (the
  /// CUDA deadlock rule, see engine.cpp); empty: none.
  std::vector<Payload> run(const Schedule& schedule, std::vector<Payload> sources, const CellFn& cell,
                           const at::ThreadLocalState& state,
                           const std::vector<bool>& inline_stages = {});

  /// The stage whose cell the calling thread is running now (of any
  /// executor), or -1.
  static int64_t current_stage() noexcept;

 private:
  struct Run;
  struct Worker;

  static void perform(Run& run, int64_t stage, const Action& action);
  void work(Worker& worker);

  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace gpipe::detail
