// fake_accelerator.cpp — the pretend accelerator's guard: vector clocks for streams and events (see fake_accelerator.h).
#include "fake_accelerator.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace gpipe_test {

namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;
// Stream ids: 0 the default stream, then the low- and high-priority pools.
constexpr c10::StreamId kLowPool = 1;
constexpr c10::StreamId kHighPool = kLowPool + FakeAccelerator::kPoolSize;

using Key = std::pair<c10::DeviceIndex, c10::StreamId>;
using Clock = std::map<Key, int64_t>;

Key key_of(const c10::Stream& s) { return {s.device_index(), s.id()}; }

void merge(Clock& into, const Clock& from) {
  for (const auto& [k, n] : from) into[k] = std::max(into[k], n);
}

struct FakeEvent {
  Clock clock;
};

// Everything the fake knows, behind one mutex (streams are used from worker
// threads). Current streams are per thread; `generation` makes a reset
// reach every thread's.
struct State {
  std::mutex mutex;
  std::map<Key, Clock> clocks;
  std::map<c10::DeviceIndex, int64_t> low_draws, high_draws;
  std::vector<std::pair<const void*, c10::Stream>> records;
  int64_t generation = 0;
};

State& state() {
  static State s;
  return s;
}

c10::Stream stream_of(c10::DeviceIndex index, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index), id);
}

struct ThreadStreams {
  int64_t generation = -1;
  c10::DeviceIndex device = 0;
  std::map<c10::DeviceIndex, c10::StreamId> current;
};

ThreadStreams& thread_streams() {
  thread_local ThreadStreams mine;
  const int64_t now = state().generation;
  if (mine.generation != now) mine = ThreadStreams{now, 0, {}};
  return mine;
}

class Guard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    std::lock_guard<std::mutex> hold(state().mutex);
    return c10::Device(kType, thread_streams().device);
  }
  void setDevice(c10::Device d) const override { uncheckedSetDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    std::lock_guard<std::mutex> hold(state().mutex);
    thread_streams().device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    std::lock_guard<std::mutex> hold(state().mutex);
    auto& mine = thread_streams().current;
    const auto it = mine.find(d.index());
    return stream_of(d.index(), it == mine.end() ? 0 : it->second);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return stream_of(d.index(), 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    std::lock_guard<std::mutex> hold(state().mutex);
    auto& draws = high ? state().high_draws : state().low_draws;
    const int64_t n = draws[d.index()]++;
    return stream_of(d.index(), (high ? kHighPool : kLowPool) + n % FakeAccelerator::kPoolSize);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    std::lock_guard<std::mutex> hold(state().mutex);
    auto& mine = thread_streams().current;
    const auto it = mine.find(s.device_index());
    const c10::Stream old = stream_of(s.device_index(), it == mine.end() ? 0 : it->second);
    mine[s.device_index()] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    // None that the autograd engine should start a thread for: the fake
    // holds no tensors autograd could run nodes on.
    return 0;
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    std::lock_guard<std::mutex> hold(state().mutex);
    if (*event == nullptr) *event = new FakeEvent();
    static_cast<FakeEvent*>(*event)->clock = state().clocks[key_of(stream)];
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;
    std::lock_guard<std::mutex> hold(state().mutex);
    merge(state().clocks[key_of(stream)], static_cast<FakeEvent*>(event)->clock);
  }
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<FakeEvent*>(event);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    std::lock_guard<std::mutex> hold(state().mutex);
    state().records.emplace_back(data.get(), stream);
  }
};

}  // namespace

void FakeAccelerator::install() {
  static const bool installed = [] {
    TORCH_CHECK(!c10::impl::hasDeviceGuardImpl(kType),
                "a device guard is already registered for PrivateUse1; the fake accelerator "
                "needs that device type for itself");
    c10::impl::registerDeviceGuard(kType, new Guard());
    return true;
  }();
  (void)installed;
  reset();
}

void FakeAccelerator::reset() {
  std::lock_guard<std::mutex> hold(state().mutex);
  state().clocks.clear();
  state().low_draws.clear();
  state().high_draws.clear();
  state().records.clear();
  ++state().generation;
}

c10::Device FakeAccelerator::device(c10::DeviceIndex index) { return c10::Device(kType, index); }

c10::Stream FakeAccelerator::pool_stream(c10::DeviceIndex index) {
  return c10::impl::getDeviceGuardImpl(kType)->getStreamFromGlobalPool(device(index), false);
}

c10::Stream FakeAccelerator::default_stream(c10::DeviceIndex index) { return stream_of(index, 0); }

c10::Stream FakeAccelerator::current_stream(c10::DeviceIndex index) {
  return c10::impl::getDeviceGuardImpl(kType)->getStream(device(index));
}

FakeWork FakeAccelerator::enqueue(const c10::Stream& stream) {
  std::lock_guard<std::mutex> hold(state().mutex);
  auto& clock = state().clocks[key_of(stream)];
  const int64_t n = ++clock[key_of(stream)];
  return {stream, n};
}

bool FakeAccelerator::after(const c10::Stream& stream, const FakeWork& work) {
  std::lock_guard<std::mutex> hold(state().mutex);
  const auto& clock = state().clocks[key_of(stream)];
  const auto it = clock.find(key_of(work.stream));
  return it != clock.end() && it->second >= work.count;
}

std::vector<std::pair<const void*, c10::Stream>> FakeAccelerator::records() {
  std::lock_guard<std::mutex> hold(state().mutex);
  return state().records;
}

}  // namespace gpipe_test
