// fake_accelerator.h — a pretend accelerator (PrivateUse1) whose streams and events keep only order: which queued work each stream is known to come after.
//
// No development machine has a GPU, so the stream orderings of streams.h
// could not be tested on a CPU. This fake stands in for the device guard
// (c10::impl::DeviceGuardImplInterface) CUDA registers: streams, pools,
// current streams per thread, events and recordDataPtrOnStream, with no
// memory and no kernels. Each stream keeps a vector clock:
//
//   enqueue(s)      s does one more piece of work (its own count + 1)
//   record(e, s)    e remembers s's clock
//   block(e, s)     s's clock becomes the maximum of its own and e's
//   after(s, w)     work queued on s from now on comes after w
//
// So a test queues "work" on a lane's streams, calls the function under test
// and asks which streams now come after that work, across devices too (a
// cudaStreamWaitEvent on another device's event is legal, as here). Pool
// streams are handed out round-robin, 32 per device and priority, as CUDA's.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <vector>

namespace gpipe_test {

/// Work queued on a stream: the stream and its count after it.
struct FakeWork {
  c10::Stream stream;
  int64_t count;
};

/// The fake, installed for PrivateUse1 on first use (installing never undoes
/// itself: c10's registry leaks its guards). `reset()` forgets every stream,
/// event, draw and record, and makes each device's default stream current on
/// the calling thread.
class FakeAccelerator {
 public:
  static constexpr int kPoolSize = 32;

  /// Installs the fake (once) and resets it.
  static void install();
  static void reset();

  static c10::Device device(c10::DeviceIndex index);
  /// A stream of the pool on `index` (as getStreamFromGlobalPool hands out).
  static c10::Stream pool_stream(c10::DeviceIndex index);
  static c10::Stream default_stream(c10::DeviceIndex index);
  /// The calling thread's current stream on `index`.
  static c10::Stream current_stream(c10::DeviceIndex index);

  /// Queues one piece of work on `stream`.
  static FakeWork enqueue(const c10::Stream& stream);
  /// Whether work queued on `stream` from now on comes after `work`.
  static bool after(const c10::Stream& stream, const FakeWork& work);
  /// Every stream a data pointer was recorded on (recordDataPtrOnStream),
  /// in order: for checking the caching allocator is told where memory is
  /// used.
  static std::vector<std::pair<const void*, c10::Stream>> records();
};

}  // namespace gpipe_test
