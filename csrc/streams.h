// streams.h — each stage's compute and copy streams, and handing a batch from one stream to another.
//
// Everything here is a no-op on CPU (the CPU guard has one stream and its
// event calls throw): the orderings below concern accelerator streams only.
//
// A step, as the streams see it (stage j on accelerator d; cur(d) is the
// caller's current stream on d; "rec" records an event, "wait" waits for one):
//
//   cur(d)     optimizer.step() rec(e0)                                  wait(e1) optimizer.step()
//   j copy                      wait(e0) copies in ...             rec(e1)
//   j compute                   wait(e0) F(0)..F(M-1) B(M-1)..B(0) rec(e1)
//                               ^                                  ^
//                    wait_for_current_streams           current_streams_wait_for
//
// Without the first wait, F reads parameters optimizer.step() is still
// writing; without the second, optimizer.step() reads .grad before B has
// written it. Autograd orders a consumer of PipeBackward's grads after
// PipeBackward's stream, which is cur(d) on the OUTPUT's device, even where
// the grad and its consumer live on another device (torch 2.9+; before, the
// default stream of the grad's device): so the second wait is every
// device's current and default stream waiting for every lane, on every
// device, and for the copies that take input grads home (`also` in
// `current_streams_wait_for`). A backward() called under another stream
// than the forward's waits for the default streams through the Pipe's
// stream leaves (pipe_backward.h).
//
// A hand-over between stages (a Payload carries the producer's `ready`
// events; `receive` orders the consumer after them):
//
//   j-1 compute (d0)  F(i) rec(ready)
//   source copy (d0)            wait(ready) copy d0 -> d1
//   j copy (d1)                 wait(ready)              wait(copy) rec(done)
//   j compute (d1)                                                  wait(done) F(i)
//
// ATen enqueues a device-to-device copy on the SOURCE device's current
// stream, with a two-way barrier to the destination's current stream
// ("wait(copy)" above). So during the copy both copy streams are current:
// the copy runs on the source copy stream (one per receiving lane and source
// device, `Lane::sources`), not on whatever the thread had current on d0. A
// CPU source (host -> device) copies on j's copy stream; a CPU destination
// waits for `ready` on the host, then copies on the source copy stream.
//
// Memory that crosses streams (the caching allocator reuses a freed block
// on the stream it was allocated on, as soon as the host frees it):
//   * the source of a copy is recorded on the source copy stream that reads it;
//   * everything a stage receives is recorded on its compute stream;
//   * what we hand to the caller (outputs in `settle`; input grads in
//     `settle`; parameter and other leaf grads summed on a stage stream:
//     `record_on_current_streams`) is recorded on the caller's current
//     stream of its device. So when the caller frees it there (zero_grad()
//     setting .grad to None, dropping an output), the block is not handed
//     out again to a stage stream before cur(d) has finished reading it.
// A block the caller frees that autograd allocated on a stage stream (a .grad
// accumulated there, when the parameter's accumulator was made on a worker)
// is covered by `wait_for_current_streams` at the next step: no stage stream
// allocates again before it has waited for cur(d). (Pool streams are shared
// within the process: another user of the same pool stream is not covered.)
#pragma once

#include "microbatch.h"

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <mutex>
#include <vector>

namespace gpipe::detail {

class Span;

/// Streams on other devices that copies into one lane run on: one pool
/// stream per source device, made on first use. Thread-safe.
class SourceStreams {
 public:
  SourceStreams() = default;
  SourceStreams(const SourceStreams&) = delete;
  SourceStreams& operator=(const SourceStreams&) = delete;
  ~SourceStreams();
  /// The stream on `source` that copies from `source` into the owning lane
  /// run on.
  c10::Stream on(c10::Device source);
  /// Every stream made so far.
  std::vector<c10::Stream> all() const;

 private:
  mutable std::mutex mutex_;
  std::vector<c10::Stream> streams_;  // each taken (take_pool_stream)
};

/// Pool streams gpipe holds: c10 hands out each device's pool (32 streams
/// per priority on CUDA) round-robin to everyone in the process, so past 32
/// draws a new stream is an old one again, and a lane's compute stream could
/// be another's copy stream or the transport's side stream (where an early
/// receive waits for its peer, and would hold back the compute queued
/// behind it). `take_pool_stream` draws until it gets a stream no live gpipe
/// holder has on that device; only when gpipe holds the whole pool does it
/// share the least-held one. ProcessGroupNCCL's streams and the user's come
/// from the same pool and cannot be seen: see docs/design.md (streams).
c10::Stream take_pool_stream(c10::Device device, bool high_priority = false);
/// Keeps taken streams held until the last copy of the handle goes.
using HeldStreams = std::shared_ptr<const void>;
HeldStreams hold(std::vector<c10::Stream> taken);
/// How many holds gpipe has on the stream (tests).
int pool_stream_holds(const c10::Stream& stream);

/// A device and the streams one stage uses on it.
struct Lane {
  c10::Device device;
  c10::Stream compute;
  /// Copies into this stage run here (and, for a device-to-device copy, on
  /// the source device's stream in `sources` at the same time).
  c10::Stream copy;
  /// Shared by copies of the Lane.
  std::shared_ptr<SourceStreams> sources = std::make_shared<SourceStreams>();
  /// compute and copy, held while a copy of the Lane lives.
  HeldStreams held;
};

/// Streams from the device's pool (CPU: its single default stream).
Lane make_lane(c10::Device device);

/// A batch and the events after which its tensors are ready. No events: the
/// tensors are ready now (CPU, or already synchronised).
struct Payload {
  Batch batch;
  std::vector<std::shared_ptr<c10::Event>> ready;
};

/// Marks the work queued so far on `stream` (nothing on CPU).
std::vector<std::shared_ptr<c10::Event>> mark(const c10::Stream& stream);

/// Marks the work queued so far on the current stream of every accelerator
/// device the batch's tensors live on: how a batch handed in by the caller
/// (or by the autograd engine) becomes a Payload.
Payload from_current_streams(Batch batch);

/// Makes the payload usable on `lane.compute`: tensors on other devices are
/// copied over `lane.copy` (and the source device's copy stream); everything
/// is ordered by events and recorded on the compute stream. Call with no
/// stream guard needed. When `copy` is given and something is copied, it is
/// restarted where the copies start (after the waits for the producers), so
/// that its finish(), right after this returns, times the copies alone.
Batch receive(Payload payload, const Lane& lane, Span* copy = nullptr);

/// Makes the payload usable on the current stream of each tensor's device
/// (the caller's side, after the last stage), and records each tensor there.
/// Those streams, and the current streams of the events' devices, wait for
/// every ready event, whatever device it was recorded on.
Batch settle(Payload payload);

/// Start of a step (a forward or a backward call): every stream of every
/// lane (compute, copy, source copy) waits for the caller's current stream
/// on that stream's device, where
/// the caller may just have updated the parameters (optimizer.step()) or
/// written the input. Call on the caller's thread, before any cell runs.
void wait_for_current_streams(const std::vector<const Lane*>& lanes);

/// End of a step: the current stream on every device a lane uses or `also`
/// names (and that device's default stream, where autograd assumes a grad
/// coming from another device was produced) waits for all work queued so
/// far on every stream of every lane and on the current streams of the
/// devices in `also`, on every device: autograd may order a consumer on one
/// device after the producer's stream on another. Call on the thread that
/// returns to the caller (for backward: the one running PipeBackward, whose
/// current stream is the one autograd takes PipeBackward's grads from),
/// after the last cell, and after the copies that hand values back to the
/// devices in `also`.
void current_streams_wait_for(const std::vector<const Lane*>& lanes,
                              const std::vector<c10::Device>& also = {});

/// Records each accelerator tensor on the current stream of its device: for
/// tensors made on a stage stream and handed to the caller (summed parameter
/// grads), so the caching allocator does not reuse their memory while the
/// caller's stream still reads it. Order the current streams after the
/// producers first (`current_streams_wait_for` or `settle`).
void record_on_current_streams(const std::vector<at::Tensor>& tensors);

}  // namespace gpipe::detail
