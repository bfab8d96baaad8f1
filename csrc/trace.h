// trace.h — the recorder behind gpipe::Trace: one cheap check when off, a locked append to a bounded window when on.
#pragma once

#include <gpipe/trace.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace gpipe::detail {

/// Records what the cells ran, thread-safely. Two kinds of records:
///
/// * Host-timed (CPU stages, and whatever runs on the host): start and end
///   are steady_clock times, taken by the thread that did the work.
/// * Device-timed (a cell on an accelerator stream): the host only enqueues
///   the work, so host times would say when kernels were queued, not when
///   they ran, and the bubble would be meaningless. The Span records a
///   timing event on the stream before and after the work instead; the
///   Tracer keeps the pair unresolved (no synchronisation on the hot path)
///   and turns it into times later, on the host timeline:
///
///     cell stream      ... rec(start) kernels rec(end) ...
///     reference (d)                                        rec(ref)  [host waits for ref only]
///     host clock                                        h0 ........ h1
///
///     start_us = (h0 + h1) / 2 - elapsed(start -> ref),  end_us = start_us + elapsed(start -> end)
///
///   The reference is recorded on an otherwise idle high-priority pool
///   stream once every pending end event is complete, so it runs at once
///   and its device time lies in [h0, h1] (a few microseconds). Resolution
///   happens in `snapshot()` (which waits for the pending end events: call
///   it after the steps you want to see), and, to bound what is pending, in
///   `record` once many completed pairs have piled up (only those already
///   complete; that costs one short wait for a new reference).
///
/// The kept events are a window of whole steps, at most `capacity()` events
/// (see gpipe::Trace): appending past it drops the oldest step's events
/// (mostly at the front, so dropping costs about what appending did).
class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  Tracer() : origin_(Clock::now()) {}
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  void enable(bool on) noexcept { enabled_.store(on, std::memory_order_relaxed); }

  /// Keeps at most `events` events from now on (dropping the oldest steps
  /// at once if more are kept). Throws c10::ValueError when `events` < 1.
  void set_capacity(int64_t events);
  int64_t capacity() const;

  /// The number of the forward call starting now.
  int64_t next_step() noexcept { return steps_.fetch_add(1, std::memory_order_relaxed); }

  /// Where every event's time is counted from.
  Clock::time_point origin() const noexcept { return origin_; }

  /// A host-timed event; `peer`: see TraceEvent::peer (Send, Receive).
  void record(int64_t step, int64_t stage, int64_t microbatch, TracePhase phase,
              Clock::time_point start, Clock::time_point end, int32_t peer = -1);

  /// A device-timed event: `start` and `end` were recorded (in that order)
  /// on one accelerator stream, with timing enabled. Resolved later.
  void record(int64_t step, int64_t stage, int64_t microbatch, TracePhase phase,
              c10::Event start, c10::Event end);

  /// Every event so far, device-timed ones resolved (waits for their end
  /// events). Host-timed events keep the order they were recorded in; when
  /// device-timed ones are merged in, all are ordered by end time.
  Trace snapshot() const;
  void clear();

 private:
  /// A device-timed event waiting for its times.
  struct Pending {
    TraceEvent event;
    c10::Event start;
    c10::Event end;
  };
  /// Resolves the pending events whose end has completed (all of them when
  /// `wait`, after waiting for each). Called with `mutex_` held.
  void resolve(bool wait) const;
  /// Keeps `e`, or drops it if its step was dropped already; then trims the
  /// window to the capacity. Called with `mutex_` held.
  void keep(const TraceEvent& e) const;
  /// Drops steps, oldest first, until at most `capacity_` events are kept.
  /// Called with `mutex_` held.
  void trim() const;

  const Clock::time_point origin_;
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> steps_{0};
  mutable std::mutex mutex_;
  mutable std::deque<TraceEvent> events_;
  /// Per step: how many of its events `events_` holds.
  mutable std::map<int64_t, int64_t> per_step_;
  /// Events recorded and then dropped (or dropped on arrival).
  mutable int64_t dropped_ = 0;
  /// Steps up to this one were dropped: their late events are dropped too.
  mutable int64_t dropped_through_ = -1;
  size_t capacity_ = static_cast<size_t>(kDefaultTraceCapacity);
  mutable std::vector<Pending> pending_;
  /// `record` tries to resolve when this many are pending.
  mutable size_t next_resolve_ = 4096;
};

/// Times one piece of work when tracing is on; records it on `finish()`
/// (not when the work throws: a failed cell is not in the trace). Costs one
/// relaxed load when tracing is off.
///
/// Host-timed, or device-timed on the stream the work runs on:
///
///   Span span(tracer, step, j, i, TracePhase::Forward, stage.lane().compute);
///   ... enqueue the cell on that stream ...
///   span.finish();
///
/// On a CPU stream the second form is the first (host times).
class Span {
 public:
  /// Host-timed, from now.
  Span(Tracer& tracer, int64_t step, int64_t stage, int64_t microbatch, TracePhase phase)
      : tracer_(tracer),
        step_(step),
        stage_(stage),
        microbatch_(microbatch),
        phase_(phase),
        active_(tracer.enabled()) {
    if (active_) start_ = Tracer::Clock::now();
  }
  /// Timed on `stream` from this point of its queue: by device events on an
  /// accelerator (see Tracer), on the host on CPU.
  Span(Tracer& tracer, int64_t step, int64_t stage, int64_t microbatch, TracePhase phase,
       const c10::Stream& stream)
      : Span(tracer, step, stage, microbatch, phase) {
    restart(stream);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  /// Starts over from now, host-timed. (All of these do nothing when tracing
  /// was off at construction.)
  void restart() {
    if (!active_) return;
    device_start_.reset();
    start_ = Tracer::Clock::now();
  }
  /// Starts over from this point of `stream`'s queue.
  void restart(const c10::Stream& stream);

  /// Records the span: ends now (host-timed) or where the queue of the
  /// stream it started on now is (device-timed).
  void finish();

 private:
  Tracer& tracer_;
  int64_t step_, stage_, microbatch_;
  TracePhase phase_;
  bool active_;
  std::optional<Tracer::Clock::time_point> start_;
  std::optional<c10::Event> device_start_;
  std::optional<c10::Stream> stream_;
};

}  // namespace gpipe::detail
