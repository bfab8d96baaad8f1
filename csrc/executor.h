// executor.h — persistent worker threads (one per device) running a schedule's or a plan's lists.
//
// Stage j runs on worker j mod W (W workers; more stages than workers with
// virtual stages). `run` gives each worker the actions of its stages: an
// action waits for its input from the neighbouring stage (forward from j-1,
// backward from j+1; the ends are fed by `sources` and drain into the
// result), runs the cell, and hands its output on through in-process
// mailboxes (transport.h). `run_plan` gives each worker its list of a
// training plan (plan.h); the task function does its own hand-offs. Either
// way the first cell that throws cancels the run: no new cell starts, every
// waiting worker wakes up and stops, and the call rethrows that error as a
// CellError naming stage, micro-batch and phase once all workers are idle
// again.
#pragma once

#include "transport.h"
#include "plan.h"
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

/// Runs one task of a plan on the calling worker: receives what it needs
/// and sends what it makes through the run's hand-off itself. May set
/// `phase` to name the part that is running ("loss", "recompute").
using TaskFn = std::function<void(const Task& task, const char*& phase)>;

class Executor {
 public:
  /// Starts `workers` workers. `intra_op_threads[w]` > 0 fixes worker w's
  /// intra-op thread count (as `at::set_num_threads` on that thread); 0, or
  /// no entry, leaves it at torch's setting. Other threads' counts stay as
  /// they were (see executor.cpp).
  explicit Executor(int64_t workers, const std::vector<int>& intra_op_threads = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  int64_t workers() const noexcept { return static_cast<int64_t>(workers_.size()); }

  /// Runs `schedule` and returns, per micro-batch, what left the pipeline
  /// (the last stage's forward outputs, or the first stage's input grads).
  /// Workers run with `state` as their thread-local state. The calling
  /// thread runs the cells of the stages marked in `inline_stages` itself,
  /// in `serialize(schedule)` order, while the workers run the others (the
  /// CUDA deadlock rule, see engine_backward.cpp); empty: none. `placement[s]`: the
  /// worker of stage s (empty: s mod workers()).
  std::vector<Payload> run(const Schedule& schedule, std::vector<Payload> sources, const CellFn& cell,
                           const at::ThreadLocalState& state,
                           const std::vector<bool>& inline_stages = {},
                           const std::vector<int64_t>& placement = {});

  /// Runs `plan` (checked with `validate` by the caller): worker w runs
  /// `plan.lists[w]` in order, calling `task` for each, under `state`. The
  /// first task that throws cancels `transport` (waking every receive) and
  /// is rethrown as a CellError once every worker has stopped. `lists`, when
  /// given, picks the plan's lists this executor runs, one per worker
  /// (worker w runs `plan.lists[lists[w]]`): one rank of a distributed
  /// pipeline runs its own list, the other ranks theirs.
  void run_plan(const Plan& plan, const TaskFn& task, Transport& transport,
                const at::ThreadLocalState& state, const std::vector<int64_t>& lists = {});

  /// The stage whose cell the calling thread is running now (of any
  /// executor), or -1.
  static int64_t current_stage() noexcept;

 private:
  struct Run;
  struct Worker;

  using Job = std::function<void(int64_t worker)>;
  static void perform(Run& run, int64_t stage, const Action& action);
  /// Runs `job` on every worker not marked in `skip` (each on its own
  /// thread, under `state`); `inline_part` meanwhile on the calling thread.
  /// Returns once all are done.
  void dispatch(const Job& job, const at::ThreadLocalState& state, const std::vector<bool>& skip,
                const std::function<void()>& inline_part);
  void work(Worker& worker);

  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace gpipe::detail
