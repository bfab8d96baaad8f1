// phase.h (internal) — setting the flags that gpipe::is_checkpointing / is_recomputing read.
#pragma once

namespace gpipe::detail {

enum class Running { Plain, Checkpointing, Recomputing };

/// Marks the calling thread as running `running` for the guard's lifetime.
class RunningGuard {
 public:
  explicit RunningGuard(Running running);
  ~RunningGuard();
  RunningGuard(const RunningGuard&) = delete;
  RunningGuard& operator=(const RunningGuard&) = delete;

 private:
  Running previous_;
};

}  // namespace gpipe::detail
