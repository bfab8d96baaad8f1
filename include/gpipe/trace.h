// trace.h — what a Pipe ran, when and where: events, Chrome trace JSON, the measured bubble.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// The kind of work an event records. A checkpointed cell's backward is a
/// Recompute event followed by a Backward event; Copy is a stage moving its
/// input from another device (never recorded between CPU stages).
enum class TracePhase : uint8_t { Forward, Backward, Recompute, Copy };

/// "forward", "backward", "recompute" or "copy".
const char* to_string(TracePhase phase);

/// One executed action. A CPU stage's actions are timed on the host; an
/// accelerator stage's by timing events on its stream, so they say when the
/// device ran the work (not when the host queued it), placed on the same
/// host timeline within a few microseconds. Reading the trace waits for the
/// device to finish the recorded work.
struct TraceEvent {
  /// The forward call it belongs to (0, 1, ... since tracing started); a
  /// backward belongs to the step of its forward.
  int64_t step = 0;
  int64_t stage = 0;
  int64_t microbatch = 0;
  TracePhase phase = TracePhase::Forward;
  /// Microseconds since the Pipe was built.
  double start_us = 0;
  double end_us = 0;
  /// A small number per OS thread (the stage's worker, or the caller's
  /// thread where the backward runs inline).
  int64_t thread = 0;
};

/// Measured against the ideal: over every half (forward, backward) of every
/// step, the stages' busy time against stages × the half's span.
struct TraceSummary {
  int64_t stages = 0;
  /// The most micro-batches any step had.
  int64_t microbatches = 0;
  int64_t steps = 0;
  /// Per stage: microseconds spent in its forward, backward and recompute
  /// events (copies not included).
  std::vector<double> busy_us;
  /// Sum over halves of (last end − first start), in microseconds.
  double span_us = 0;
  /// 1 − Σ busy / (stages × span): the idle share of the stages' time.
  double bubble = 0;
  /// GPipe's (K−1)/(M+K−1) for these stages and micro-batches.
  double ideal_bubble = 0;

  /// A few lines for people: bubble against ideal, busy time per stage.
  std::string to_string() const;
};

/// The events recorded while tracing was on, in the order they ended.
struct Trace {
  std::vector<TraceEvent> events;

  /// Chrome trace event JSON (chrome://tracing, https://ui.perfetto.dev):
  /// one row per stage, one box per event named "F3", "B3", "R3" or "C3".
  std::string to_chrome_json() const;
  /// Writes `to_chrome_json()` to `path`; throws naming the path on failure.
  void save_chrome_json(const std::string& path) const;
  TraceSummary summary() const;
};

}  // namespace gpipe
