// trace.h — what a Pipe ran, when and where: events, Chrome trace JSON, the measured bubble.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// The kind of work an event records. A checkpointed cell's backward is a
/// Recompute event followed by a Backward event; Copy is a stage moving its
/// input from another device (never recorded between CPU stages). Send and
/// Receive are hand-offs with another rank (a pipeline over a process
/// group only; never recorded in-process or between two stages of one rank).
enum class TracePhase : uint8_t {
  /// A cell's forward.
  Forward,
  /// A cell's backward (after its Recompute when checkpointed).
  Backward,
  /// A checkpointed cell's forward run again just before its backward.
  Recompute,
  /// A stage moving its input (or grad) from another device.
  Copy,
  /// train_step: the last stage's loss of a micro-batch and its grad.
  Loss,
  /// train_step, zero-bubble: a cell's input grads (I).
  InputGrad,
  /// train_step, zero-bubble: a cell's weight grads (W).
  WeightGrad,
  /// Over a process group: the stage's worker issuing a hand-off (an
  /// activation, grad or skip) to a stage of another rank (`TraceEvent::peer`).
  Send,
  /// Over a process group: the stage's worker waiting in the transport for a
  /// hand-off from a stage of another rank (`TraceEvent::peer`), from asking
  /// until it has it: includes the wait for the peer to produce it (bubble).
  Receive,
};

/// "forward", "backward", "recompute", "copy", "loss", "input_grad",
/// "weight_grad", "send" or "receive".
const char* to_string(TracePhase phase);

/// How many events a Pipe keeps by default (see `Trace`): the most recent
/// 100,000, about 5.6 MB. A step of K stages and M micro-batches records
/// about 2·K·M events (3·K·M when checkpointed; copies add up to 2·(K−1)·M),
/// so this keeps thousands of steps of a small pipeline. Set per Pipe with
/// `PipeOptions().trace_capacity(n)`.
inline constexpr int64_t kDefaultTraceCapacity = 100000;

/// One executed action: a cell (one stage's forward, recompute or backward of
/// one micro-batch) or a copy. Times are microseconds on the host's steady
/// clock, counted from when the Pipe was built. A CPU stage's actions are
/// timed on the host; an accelerator stage's by timing events on its stream,
/// so they say when the device ran the work (not when the host queued it),
/// placed on the same host timeline within a few microseconds. Reading the
/// trace waits for the device to finish the recorded work.
struct TraceEvent {
  /// The forward call it belongs to (0, 1, ... since tracing started or the
  /// trace was last cleared); a backward belongs to the step of its forward.
  int64_t step = 0;
  /// Index of the stage that ran it (0 is the first).
  int64_t stage = 0;
  /// Index of the micro-batch within its step (0 is the first rows).
  int64_t microbatch = 0;
  /// What it ran.
  TracePhase phase = TracePhase::Forward;
  /// Send and Receive: the stage at the other end of the hand-off (the
  /// receiving stage of a Send, the sending stage of a Receive); −1 for
  /// every other phase. A Send of stage a with peer b and a Receive of stage
  /// b with peer a for the same step and micro-batch are the two ends of one
  /// hand-off. (Skips along the same two stages as an activation or grad
  /// have the same step, stages and micro-batch: they are not told apart.)
  int32_t peer = -1;
  /// When it started, in microseconds since the Pipe was built.
  double start_us = 0;
  /// When it ended, in microseconds since the Pipe was built (≥ start_us).
  double end_us = 0;
  /// A small number per OS thread (the stage's worker, or the caller's
  /// thread where the backward runs inline); numbered in order of first use
  /// across the process, not per Pipe.
  int64_t thread = 0;
};

/// What a trace says about the pipeline's efficiency, measured against GPipe's
/// ideal. Steps are split into halves: the forward half (forward events) and
/// the backward half (recompute and backward events); a `train_step` step
/// (one with loss events), whose forwards and backwards interleave, is one
/// span. Each half of each step has a span: from its first event's start to
/// its last event's end. Copies, sends and receives are not work: they count
/// toward no stage's busy time and no span.
struct TraceSummary {
  /// Stages seen in the trace (highest stage index + 1).
  int64_t stages = 0;
  /// The most micro-batches any step had.
  int64_t microbatches = 0;
  /// Steps with at least one event in the trace.
  int64_t steps = 0;
  /// Per stage: microseconds spent in its compute events (forward,
  /// backward, recompute; under train_step loss, input_grad, weight_grad);
  /// copies, sends and receives not included.
  std::vector<double> busy_us;
  /// Sum over every half of every step of (last end − first start), in
  /// microseconds: the wall time the trace's work took, the gaps between
  /// halves (the caller's own code: loss, optimizer) left out.
  double span_us = 0;
  /// The measured idle share of the stages' time inside the spans:
  /// 1 − Σ busy_us / (stages × span_us), counting the threads that ran cells
  /// instead of the stages when several stages share a worker (virtual
  /// stages under train_step). 0 means every stage was busy from
  /// the first start to the last end of every half; it also includes the
  /// engine's own overhead between cells and any imbalance between stages.
  double bubble = 0;
  /// GPipe's bubble for perfectly balanced stages and free hand-offs:
  /// (K−1)/(M+K−1) with K = `stages` and M = `microbatches`: each stage idles
  /// K−1 of the M+K−1 slots of a half while the pipeline fills and drains.
  double ideal_bubble = 0;

  /// A few lines for people: bubble against ideal, busy time per stage.
  std::string to_string() const;
};

/// The events recorded while tracing was on, in the order they ended.
///
/// A Pipe keeps only the most recent events, at most its trace capacity
/// (`PipeOptions::trace_capacity`, default `kDefaultTraceCapacity`), so a
/// long run traces in bounded memory. It drops whole steps, oldest first, so
/// `summary()` measures complete steps; only when the newest step alone has
/// more events than the capacity does it keep that step's newest events
/// (a partial step, whose summary is not meaningful: raise the capacity).
/// An event that arrives for a step already dropped (a late backward) is
/// dropped too.
struct Trace {
  /// The kept events, in the order they were recorded.
  std::vector<TraceEvent> events;
  /// Events recorded but no longer kept (since tracing started or the trace
  /// was last cleared); 0 when nothing was dropped.
  int64_t dropped = 0;

  /// Chrome trace event JSON (chrome://tracing, https://ui.perfetto.dev):
  /// one row per stage, one box per event named "F3", "B3", "R3" or "C3"
  /// (micro-batch 3; "Tx3" and "Rx3" for a send and a receive, with the
  /// peer stage in its args).
  std::string to_chrome_json() const;
  /// Writes `to_chrome_json()` to `path`; throws naming the path on failure.
  void save_chrome_json(const std::string& path) const;
  /// The measured bubble against GPipe's ideal, over the events kept.
  TraceSummary summary() const;
};

}  // namespace gpipe
