// executor.cpp — persistent per-stage workers, mailboxes between neighbours, first-error cancellation.
#include "executor.h"

#include <gpipe/error.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <latch>
#include <optional>

namespace gpipe::detail {

namespace {

// How long a worker spins for its next input before it parks: about what
// parking and waking a thread costs on a VM (futex, context switches).
constexpr std::chrono::microseconds kSpin{50};

thread_local int64_t running_stage = -1;

// Marks the calling thread as running a cell of `stage`.
class InCell {
 public:
  explicit InCell(int64_t stage) : previous_(running_stage) { running_stage = stage; }
  ~InCell() { running_stage = previous_; }
  InCell(const InCell&) = delete;
  InCell& operator=(const InCell&) = delete;

 private:
  int64_t previous_;
};

}  // namespace

int64_t Executor::current_stage() noexcept { return running_stage; }

// The shared state of one `run` call. Lives on the caller's stack; workers
// only touch it between picking up their job and reporting it done.
struct Executor::Run {
  const Schedule* schedule = nullptr;
  const CellFn* cell = nullptr;
  int64_t stages = 0;
  int64_t microbatches = 0;

  // One hand-over: written once by the neighbour, read once by the stage.
  // Setting `full` (after the payload is written) publishes `payload`.
  struct Slot {
    Payload payload;
    std::atomic<bool> full{false};
  };
  // Inbox of each stage: per phase and micro-batch, the payload handed over.
  // The stage's worker spins briefly for an input before it parks on
  // `arrived`; a sender takes the mutex and notifies only when it is parked.
  struct Inbox {
    std::mutex mutex;
    std::condition_variable arrived;
    std::atomic<int> parked{0};
    std::vector<Slot> slots[2];
  };
  std::vector<Inbox> inbox;
  std::vector<Payload> sinks;

  std::atomic<bool> cancelled{false};
  std::mutex error_mutex;
  std::exception_ptr error;

  Run(const Schedule& s, const CellFn& fn)
      : schedule(&s),
        cell(&fn),
        stages(static_cast<int64_t>(s.stages.size())),
        microbatches(s.microbatches),
        inbox(static_cast<size_t>(stages)),
        sinks(static_cast<size_t>(s.microbatches)) {
    for (auto& box : inbox) {
      for (auto& phase : box.slots) phase = std::vector<Slot>(static_cast<size_t>(microbatches));
    }
  }

  Slot& slot(int64_t stage, Phase phase, int64_t microbatch) {
    return inbox[static_cast<size_t>(stage)]
        .slots[static_cast<int>(phase)][static_cast<size_t>(microbatch)];
  }

  void put(int64_t stage, Phase phase, int64_t microbatch, Payload payload) {
    auto& box = inbox[static_cast<size_t>(stage)];
    auto& s = slot(stage, phase, microbatch);
    s.payload = std::move(payload);
    // seq_cst pairs with the parking worker's increment of `parked` and its
    // check of `full`: either it sees the payload or we see it parked.
    s.full.store(true);
    if (box.parked.load() > 0) {
      // Taking the mutex orders the store before the worker's wait.
      { std::lock_guard<std::mutex> hold(box.mutex); }
      box.arrived.notify_all();
    }
  }

  // Waits for the input of (stage, phase, microbatch); nullopt when
  // cancelled. Cells on CPU can be tens of microseconds, less than waking a
  // parked thread takes, so the worker first spins (yielding its core to
  // any other runnable thread) for a short while.
  std::optional<Payload> take(int64_t stage, Phase phase, int64_t microbatch) {
    auto& box = inbox[static_cast<size_t>(stage)];
    auto& s = slot(stage, phase, microbatch);
    auto arrived = [&] { return s.full.load() || cancelled.load(); };
    if (!arrived()) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (!arrived() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    if (!arrived()) {
      std::unique_lock<std::mutex> hold(box.mutex);
      box.parked.fetch_add(1);
      box.arrived.wait(hold, arrived);
      box.parked.fetch_sub(1);
    }
    if (!s.full.load()) return std::nullopt;
    return std::move(s.payload);
  }

  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> hold(error_mutex);
      if (!error) error = std::move(e);
    }
    cancelled.store(true);
    for (auto& box : inbox) {
      // Taking the mutex orders the flag before any waiter's next check.
      { std::lock_guard<std::mutex> hold(box.mutex); }
      box.arrived.notify_all();
    }
  }
};

struct Executor::Worker {
  std::thread thread;
  std::mutex mutex;
  std::condition_variable wake;
  std::condition_variable idle;
  // The job: run `actions` of `stage` in `run` under `state`.
  Run* run = nullptr;
  const at::ThreadLocalState* state = nullptr;
  int64_t stage = 0;
  bool stop = false;
};

Executor::Executor(int64_t stages, const std::vector<int>& intra_op_threads) {
  TORCH_CHECK(stages >= 1, "an executor needs at least one stage, got ", stages);
  TORCH_CHECK(intra_op_threads.empty() || static_cast<int64_t>(intra_op_threads.size()) == stages,
              "intra_op_threads has ", intra_op_threads.size(), " entries for ", stages,
              " stages");
  for (int64_t j = 0; j < stages; ++j) {
    workers_.push_back(std::make_unique<Worker>());
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
  std::latch ready(stages);
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
  if (run.cancelled.load()) return;
  const bool forward = action.phase == Phase::Forward;
  const int64_t i = action.microbatch;
  auto input = run.take(stage, action.phase, i);
  if (!input || run.cancelled.load()) return;
  const char* phase = forward ? "forward" : "backward";
  try {
    InCell in_cell(stage);
    Payload out = (*run.cell)(stage, action, std::move(*input), phase);
    const int64_t next = forward ? stage + 1 : stage - 1;
    if (next < 0 || next >= run.stages) {
      run.sinks[static_cast<size_t>(i)] = std::move(out);
    } else {
      run.put(next, action.phase, i, std::move(out));
    }
  } catch (...) {
    run.fail(std::make_exception_ptr(CellError(stage, i, phase, std::current_exception())));
  }
}

void Executor::work(Worker& worker) {
  for (;;) {
    Run* run = nullptr;
    const at::ThreadLocalState* state = nullptr;
    {
      std::unique_lock<std::mutex> hold(worker.mutex);
      worker.wake.wait(hold, [&] { return worker.stop || worker.run != nullptr; });
      if (worker.stop) return;
      run = worker.run;
      state = worker.state;
    }
    {
      at::ThreadLocalStateGuard guard(*state);
      for (const auto& action : run->schedule->stages[static_cast<size_t>(worker.stage)]) {
        if (run->cancelled.load()) break;
        perform(*run, worker.stage, action);
      }
    }
    {
      std::lock_guard<std::mutex> hold(worker.mutex);
      worker.run = nullptr;
      worker.state = nullptr;
    }
    worker.idle.notify_one();
  }
}

std::vector<Payload> Executor::run(const Schedule& schedule, std::vector<Payload> sources,
                                   const CellFn& cell, const at::ThreadLocalState& state,
                                   const std::vector<bool>& inline_stages) {
  TORCH_CHECK(static_cast<int64_t>(schedule.stages.size()) == stages(), "schedule has ",
              schedule.stages.size(), " stages but the executor has ", stages());
  TORCH_CHECK(static_cast<int64_t>(sources.size()) == schedule.microbatches, "got ",
              sources.size(), " sources for ", schedule.microbatches, " micro-batches");
  Run run(schedule, cell);
  // Sources enter at the first stage in their direction: the input at stage
  // 0 when the schedule runs forward cells, the output grads at the last
  // stage for a backward-only schedule.
  bool has_forward = false;
  for (const auto& actions : schedule.stages) {
    for (const auto& a : actions) has_forward = has_forward || a.phase == Phase::Forward;
  }
  const Phase entry_phase = has_forward ? Phase::Forward : Phase::Backward;
  const int64_t entry = has_forward ? 0 : stages() - 1;
  for (int64_t i = 0; i < schedule.microbatches; ++i) {
    run.put(entry, entry_phase, i, std::move(sources[static_cast<size_t>(i)]));
  }

  TORCH_CHECK(inline_stages.empty() || static_cast<int64_t>(inline_stages.size()) == stages(),
              "inline_stages has ", inline_stages.size(), " entries for ", stages(), " stages");
  auto runs_inline = [&](size_t j) { return !inline_stages.empty() && inline_stages[j]; };
  std::vector<Worker*> started;
  for (size_t j = 0; j < workers_.size(); ++j) {
    if (runs_inline(j)) continue;
    auto& w = *workers_[j];
    {
      std::lock_guard<std::mutex> hold(w.mutex);
      w.run = &run;
      w.state = &state;
      w.stage = static_cast<int64_t>(j);
    }
    w.wake.notify_one();
    started.push_back(&w);
  }
  if (started.size() != workers_.size()) {
    // Every thread follows one global order (serialize's, which each
    // stage's own list agrees with), so no two wait on each other.
    for (const auto& step : serialize(schedule)) {
      if (run.cancelled.load()) break;
      if (runs_inline(static_cast<size_t>(step.stage))) perform(run, step.stage, step.action);
    }
  }
  for (Worker* w : started) {
    std::unique_lock<std::mutex> hold(w->mutex);
    w->idle.wait(hold, [&] { return w->run == nullptr; });
  }
  if (run.error) std::rethrow_exception(run.error);
  return std::move(run.sinks);
}

}  // namespace gpipe::detail
