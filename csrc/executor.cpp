// executor.cpp — persistent workers running schedules and plans, first-error cancellation.
#include "executor.h"

#include "cancel.h"

#include <gpipe/error.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <latch>
#include <optional>

namespace gpipe::detail {

namespace {

thread_local int64_t running_stage = -1;

// Marks the calling thread as running a cell of `stage` in the run that
// `transport` carries (cancel.h: the cell checks it and cancels it).
class InCell {
 public:
  InCell(int64_t stage, Transport& transport) : previous_(running_stage), run_(transport) {
    running_stage = stage;
  }
  ~InCell() { running_stage = previous_; }
  InCell(const InCell&) = delete;
  InCell& operator=(const InCell&) = delete;

 private:
  int64_t previous_;
  RunningIn run_;
};

}  // namespace

int64_t Executor::current_stage() noexcept { return running_stage; }

// The shared state of one `run` call. Lives on the caller's stack; workers
// only touch it between picking up their job and reporting it done.
struct Executor::Run {
  const Schedule* schedule = nullptr;
  const CellFn* cell = nullptr;
  int64_t stages = 0;
  Mailboxes mail;
  std::vector<Payload> sinks;

  std::mutex error_mutex;
  std::exception_ptr error;

  Run(const Schedule& s, const CellFn& fn)
      : schedule(&s),
        cell(&fn),
        stages(static_cast<int64_t>(s.stages.size())),
        mail(stages, s.microbatches),
        sinks(static_cast<size_t>(s.microbatches)) {}

  static Flow flow(Phase phase) { return phase == Phase::Forward ? Flow::Activation : Flow::Grad; }

  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> hold(error_mutex);
      if (!error) error = std::move(e);
    }
    mail.cancel();
  }
};

struct Executor::Worker {
  std::thread thread;
  std::mutex mutex;
  std::condition_variable wake;
  std::condition_variable idle;
  // The job, run under `state`; null when idle.
  const Job* job = nullptr;
  const at::ThreadLocalState* state = nullptr;
  int64_t index = 0;
  bool stop = false;
};

Executor::Executor(int64_t workers, const std::vector<int>& intra_op_threads) {
  TORCH_CHECK(workers >= 1, "an executor needs at least one worker, got ", workers);
  TORCH_CHECK(intra_op_threads.empty() || static_cast<int64_t>(intra_op_threads.size()) == workers,
              "intra_op_threads has ", intra_op_threads.size(), " entries for ", workers,
              " workers");
  for (int64_t w = 0; w < workers; ++w) {
    workers_.push_back(std::make_unique<Worker>());
    workers_.back()->index = w;
  }
  // at::set_num_threads sets the calling thread's OpenMP and MKL counts,
  // which is what a worker needs, but it also stores the count process-wide
  // as the one every thread started later adopts (autograd's, the user's,
  // another Pipe's workers). So each worker sets its own count first thing,
  // and once all have, this thread stores its own, unchanged, count again:
  // threads started later get what they would have got without us. (Read
  // it before any worker sets its count: a thread's first at:: call adopts
  // the process-wide count.)
  const int own = at::get_num_threads();
  std::latch ready(workers);
  bool sets_any = false;
  for (size_t j = 0; j < workers_.size(); ++j) {
    Worker* worker = workers_[j].get();
    const int threads = intra_op_threads.empty() ? 0 : intra_op_threads[j];
    sets_any = sets_any || threads > 0;
    worker->thread = std::thread([this, worker, threads, &ready] {
      // A thread's first parallel op (re)initializes its count from the
      // process-wide one, once; at::get_num_threads does that now, so the
      // count set next is the one that stays.
      if (threads > 0) {
        at::get_num_threads();
        at::set_num_threads(threads);
      }
      ready.count_down();
      work(*worker);
    });
  }
  ready.wait();
  if (sets_any) at::set_num_threads(own);
}

Executor::~Executor() {
  // Workers are idle between runs (run() returns only when all are), so
  // they see `stop` at once: joining never blocks for long.
  for (auto& w : workers_) {
    {
      std::lock_guard<std::mutex> hold(w->mutex);
      w->stop = true;
    }
    w->wake.notify_one();
  }
  for (auto& w : workers_) {
    if (w->thread.joinable()) w->thread.join();
  }
}

void Executor::perform(Run& run, int64_t stage, const Action& action) {
  if (run.mail.cancelled()) return;
  const bool forward = action.phase == Phase::Forward;
  const int64_t i = action.microbatch;
  auto input = run.mail.receive({stage, Run::flow(action.phase), i});
  if (!input || run.mail.cancelled()) return;
  const char* phase = forward ? "forward" : "backward";
  try {
    InCell in_cell(stage, run.mail);
    Payload out = (*run.cell)(stage, action, std::move(*input), phase);
    const int64_t next = forward ? stage + 1 : stage - 1;
    if (next < 0 || next >= run.stages) {
      run.sinks[static_cast<size_t>(i)] = std::move(out);
    } else {
      run.mail.send({next, Run::flow(action.phase), i}, std::move(out));
    }
  } catch (const Cancelled&) {
    // Found the run cancelled once it could start: another cell's error.
  } catch (...) {
    // Stop the other stages before describing the error, which can take
    // long (a Python error's message formats its traceback under the GIL):
    // no stage starts a cell once one failed.
    run.mail.cancel();
    run.fail(std::make_exception_ptr(CellError(stage, i, phase, std::current_exception())));
  }
}

void Executor::work(Worker& worker) {
  for (;;) {
    const Job* job = nullptr;
    const at::ThreadLocalState* state = nullptr;
    {
      std::unique_lock<std::mutex> hold(worker.mutex);
      worker.wake.wait(hold, [&] { return worker.stop || worker.job != nullptr; });
      if (worker.stop) return;
      job = worker.job;
      state = worker.state;
    }
    {
      at::ThreadLocalStateGuard guard(*state);
      (*job)(worker.index);
    }
    {
      std::lock_guard<std::mutex> hold(worker.mutex);
      worker.job = nullptr;
      worker.state = nullptr;
    }
    worker.idle.notify_one();
  }
}

void Executor::dispatch(const Job& job, const at::ThreadLocalState& state,
                        const std::vector<bool>& skip, const std::function<void()>& inline_part) {
  std::vector<Worker*> started;
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (w < skip.size() && skip[w]) continue;
    auto& worker = *workers_[w];
    {
      std::lock_guard<std::mutex> hold(worker.mutex);
      worker.job = &job;
      worker.state = &state;
    }
    worker.wake.notify_one();
    started.push_back(&worker);
  }
  // Jobs catch their own errors (they cancel the run); the inline part too.
  if (inline_part) inline_part();
  for (Worker* w : started) {
    std::unique_lock<std::mutex> hold(w->mutex);
    w->idle.wait(hold, [&] { return w->job == nullptr; });
  }
}

std::vector<Payload> Executor::run(const Schedule& schedule, std::vector<Payload> sources,
                                   const CellFn& cell, const at::ThreadLocalState& state,
                                   const std::vector<bool>& inline_stages,
                                   const std::vector<int64_t>& placement) {
  const auto stages = static_cast<int64_t>(schedule.stages.size());
  TORCH_CHECK(placement.empty() || static_cast<int64_t>(placement.size()) == stages,
              "placement has ", placement.size(), " entries for ", stages, " stages");
  TORCH_CHECK(stages >= workers() && stages % workers() == 0, "schedule has ", stages,
              " stages for ", workers(), " workers; it needs a multiple of them");
  TORCH_CHECK(static_cast<int64_t>(sources.size()) == schedule.microbatches, "got ",
              sources.size(), " sources for ", schedule.microbatches, " micro-batches");
  TORCH_CHECK(inline_stages.empty() || static_cast<int64_t>(inline_stages.size()) == stages,
              "inline_stages has ", inline_stages.size(), " entries for ", stages, " stages");
  Run run(schedule, cell);
  // Sources enter at the first stage in their direction: the input at stage
  // 0 when the schedule runs forward cells, the output grads at the last
  // stage for a backward-only schedule.
  bool has_forward = false;
  for (const auto& actions : schedule.stages) {
    for (const auto& a : actions) has_forward = has_forward || a.phase == Phase::Forward;
  }
  const Phase entry_phase = has_forward ? Phase::Forward : Phase::Backward;
  const int64_t entry = has_forward ? 0 : stages - 1;
  for (int64_t i = 0; i < schedule.microbatches; ++i) {
    run.mail.send({entry, Run::flow(entry_phase), i}, std::move(sources[static_cast<size_t>(i)]));
  }

  auto runs_inline = [&](int64_t j) {
    return !inline_stages.empty() && inline_stages[static_cast<size_t>(j)];
  };
  const auto w_count = workers();
  auto worker_of = [&](int64_t j) {
    return placement.empty() ? j % w_count : placement[static_cast<size_t>(j)];
  };
  // A worker with one stage runs that stage's list. A worker with several
  // (virtual stages), and the calling thread for the inline stages, follow
  // one global order (serialize's, which each stage's own list agrees
  // with), so no two threads wait on each other.
  std::vector<Step> order;
  if (stages > w_count || !inline_stages.empty()) order = serialize(schedule);
  std::vector<bool> idle(static_cast<size_t>(w_count), true);
  for (int64_t j = 0; j < stages; ++j) {
    if (!runs_inline(j)) idle[static_cast<size_t>(worker_of(j))] = false;
  }
  const Job job = [&](int64_t w) {
    if (stages == w_count) {
      for (const auto& action : schedule.stages[static_cast<size_t>(w)]) {
        if (run.mail.cancelled()) break;
        if (!runs_inline(w)) perform(run, w, action);
      }
      return;
    }
    for (const auto& step : order) {
      if (run.mail.cancelled()) break;
      if (worker_of(step.stage) == w && !runs_inline(step.stage)) {
        perform(run, step.stage, step.action);
      }
    }
  };
  std::function<void()> inline_part;
  if (!inline_stages.empty()) {
    inline_part = [&] {
      for (const auto& step : order) {
        if (run.mail.cancelled()) break;
        if (runs_inline(step.stage)) perform(run, step.stage, step.action);
      }
    };
  }
  dispatch(job, state, idle, inline_part);
  if (run.error) std::rethrow_exception(run.error);
  return std::move(run.sinks);
}

void Executor::run_plan(const Plan& plan, const TaskFn& task, Transport& transport,
                        const at::ThreadLocalState& state, const std::vector<int64_t>& lists) {
  TORCH_CHECK(lists.empty() ? plan.workers == workers()
                            : static_cast<int64_t>(lists.size()) == workers(),
              "plan for ", plan.workers, " workers (", lists.size(),
              " of its lists picked) on an executor of ", workers());
  for (int64_t l : lists) {
    TORCH_CHECK(l >= 0 && l < plan.workers, "list ", l, " picked from a plan of ", plan.workers);
  }
  std::mutex error_mutex;
  std::exception_ptr error;
  const Job job = [&](int64_t w) {
    const int64_t list = lists.empty() ? w : lists[static_cast<size_t>(w)];
    for (const auto& t : plan.lists[static_cast<size_t>(list)]) {
      if (transport.cancelled()) break;
      const char* phase = t.op == Op::F   ? "forward"
                          : t.op == Op::B ? "backward"
                          : t.op == Op::I ? "input-grad backward"
                                          : "weight-grad backward";
      try {
        InCell in_cell(t.stage, transport);
        task(t, phase);
      } catch (const Cancelled&) {
        break;  // as when cancelled before the task
      } catch (...) {
        transport.cancel();  // first, as in perform
        {
          std::lock_guard<std::mutex> hold(error_mutex);
          if (!error) {
            error = std::make_exception_ptr(
                CellError(t.stage, t.microbatch, phase, std::current_exception()));
          }
        }
        break;
      }
    }
  };
  dispatch(job, state, {}, {});
  if (error) std::rethrow_exception(error);
}

}  // namespace gpipe::detail
