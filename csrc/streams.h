// streams.h — each stage's compute and copy streams, and handing a batch from one stream to another.
//
// Ordering across stages (accelerators; CPU skips all of it):
//
//   stage j-1 compute stream   F(i) --record(ready)-->
//   stage j copy stream                 wait(ready)  copy  --record(done)-->
//   stage j compute stream                                  wait(done)  F(i)
//
// Tensors that cross streams are recorded on the stream that uses them
// (`recordDataPtrOnStream`), so the caching allocator cannot hand their
// memory out again before that stream is done with it.
#pragma once

#include "microbatch.h"

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <vector>

namespace gpipe::detail {

/// A device and the two streams one stage uses on it.
struct Lane {
  c10::Device device;
  c10::Stream compute;
  c10::Stream copy;
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
/// copied over `lane.copy`; everything is ordered by events and recorded on
/// the compute stream. Call with no stream guard needed.
Batch receive(Payload payload, const Lane& lane);

/// Makes the payload usable on the current stream of each tensor's device
/// (the caller's side, after the last stage).
Batch settle(Payload payload);

}  // namespace gpipe::detail
