// trace.h — the recorder behind gpipe::Trace: one cheap check when off, a locked append when on.
#pragma once

#include <gpipe/trace.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace gpipe::detail {

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  Tracer() : origin_(Clock::now()) {}

  bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  void enable(bool on) noexcept { enabled_.store(on, std::memory_order_relaxed); }

  /// The number of the forward call starting now.
  int64_t next_step() noexcept { return steps_.fetch_add(1, std::memory_order_relaxed); }

  void record(int64_t step, int64_t stage, int64_t microbatch, TracePhase phase,
              Clock::time_point start, Clock::time_point end);

  Trace snapshot() const;
  void clear();

 private:
  const Clock::time_point origin_;
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> steps_{0};
  mutable std::mutex mutex_;
  std::vector<TraceEvent> events_;
};

/// Times one piece of work when tracing is on; records it on `finish()`
/// (not when the work throws: a failed cell is not in the trace).
class Span {
 public:
  Span(Tracer& tracer, int64_t step, int64_t stage, int64_t microbatch, TracePhase phase)
      : tracer_(tracer), step_(step), stage_(stage), microbatch_(microbatch), phase_(phase) {
    if (tracer.enabled()) start_ = Tracer::Clock::now();
  }
  void finish() {
    if (start_) tracer_.record(step_, stage_, microbatch_, phase_, *start_, Tracer::Clock::now());
    start_.reset();
  }

 private:
  Tracer& tracer_;
  int64_t step_, stage_, microbatch_;
  TracePhase phase_;
  std::optional<Tracer::Clock::time_point> start_;
};

}  // namespace gpipe::detail
