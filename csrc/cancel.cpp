// cancel.cpp — the thread-local run of the cell a thread is running.
#include "cancel.h"

namespace gpipe::detail {

namespace {
thread_local Cancellable* current = nullptr;
}  // namespace

const char* Cancelled::what() const noexcept {
  return "gpipe: the run was cancelled by another cell's failure";
}

RunningIn::RunningIn(Cancellable& run) : previous_(current) { current = &run; }
RunningIn::~RunningIn() { current = previous_; }

void stop_if_cancelled() {
  if (current != nullptr && current->cancelled()) throw Cancelled();
}

void cancel_running() noexcept {
  if (current == nullptr) return;
  try {
    current->cancel();
  } catch (...) {
    // The executor cancels again as it takes the cell's error.
  }
}

}  // namespace gpipe::detail
