// cancel.h (internal) — the run a cell belongs to, as the cell sees it: whether it has failed, and failing it.
//
// The executor cancels a run when its first cell throws, and checks for that
// before each cell. A cell can also wait inside its stage (for a generator
// lock, rng.h) while another cell fails: the stage checks again once it holds
// what it waited for, and a failing cell cancels its run before it lets go
// of its locks. So no cell starts its layers once a cell of the step failed:
//
//   stage 2 (slow)              stage 3
//   F0 ......                   (waits for F0's output)
//   F1 .......  (shared lock)   F0 waits for the exclusive lock
//   F2 waits: a writer waits    F0 runs, throws: cancel_running(), unlock
//   F2 gets the lock, sees the cancel: throws Cancelled, runs nothing
#pragma once

#include <exception>

namespace gpipe::detail {

/// What can be cancelled: a transport (transport.h) is one.
class Cancellable {
 public:
  virtual ~Cancellable() = default;
  virtual void cancel() = 0;
  virtual bool cancelled() const = 0;
};

/// Thrown by a cell that finds its run cancelled before it starts its work.
/// It is not an error of its own: the executor drops it, as it drops a cell
/// it finds cancelled before starting it (the run's first error is raised).
class Cancelled final : public std::exception {
 public:
  const char* what() const noexcept override;
};

/// Marks the calling thread as running a cell of `run` for the guard's
/// lifetime (nested guards restore the outer run).
class RunningIn {
 public:
  explicit RunningIn(Cancellable& run);
  ~RunningIn();
  RunningIn(const RunningIn&) = delete;
  RunningIn& operator=(const RunningIn&) = delete;

 private:
  Cancellable* previous_;
};

/// Throws Cancelled if the calling thread's run is cancelled (nothing
/// outside a run).
void stop_if_cancelled();

/// Cancels the calling thread's run (nothing outside a run).
void cancel_running() noexcept;

}  // namespace gpipe::detail
