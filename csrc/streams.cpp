// streams.cpp — device-generic streams and events (c10 virtual guards), so one build serves CPU and CUDA torch.
#include "streams.h"

#include "trace.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/is_pinned.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace gpipe::detail {

namespace {

bool on_accelerator(const at::Tensor& t) { return t.defined() && !t.device().is_cpu(); }

void record_on(const at::Tensor& t, const c10::Stream& stream) {
  if (!on_accelerator(t) || !t.has_storage()) return;
  c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

void wait_all(const std::vector<std::shared_ptr<c10::Event>>& events, const c10::Stream& stream) {
  for (const auto& ev : events) ev->block(stream);
}

// A copy on `device` that keeps the source's requires-grad flag but no
// autograd history: stages exchange plain values, each builds its own graph.
at::Tensor moved(const at::Tensor& t, c10::Device device, bool non_blocking) {
  at::NoGradGuard no_grad;
  auto out = t.to(device, non_blocking);
  if (t.requires_grad()) out.requires_grad_(true);
  return out;
}

// Appends `x` unless `list` holds it already; whether it did.
template <typename T>
bool add_once(std::vector<T>& list, const T& x) {
  if (std::find(list.begin(), list.end(), x) != list.end()) return false;
  list.push_back(x);
  return true;
}

// Every accelerator stream of a lane: compute, copy and the source copy
// streams (a CPU lane has only the last).
std::vector<c10::Stream> streams_of(const Lane& lane) {
  std::vector<c10::Stream> out;
  if (!lane.device.is_cpu()) {
    out.push_back(lane.compute);
    if (lane.copy != lane.compute) out.push_back(lane.copy);
  }
  if (lane.sources) {
    for (const auto& s : lane.sources->all()) add_once(out, s);
  }
  return out;
}

// The stream copies from `source` into `lane` run on.
c10::Stream source_stream(const Lane& lane, c10::Device source) {
  if (lane.sources) return lane.sources->on(source);
  // A Lane made without its cache (aggregate-initialised with a null one):
  // the source device's current stream, as ATen would use anyway.
  c10::impl::VirtualGuardImpl impl(source.type());
  return impl.getStream(source);
}

// How often take_pool_stream draws before it shares: the pool's size on
// CUDA (and XPU); a smaller pool only repeats its streams sooner.
constexpr int kPoolDraws = 32;

struct Holds {
  std::mutex mutex;
  std::vector<std::pair<c10::Stream, int>> counts;  // only streams held now

  std::vector<std::pair<c10::Stream, int>>::iterator find(const c10::Stream& s) {
    return std::find_if(counts.begin(), counts.end(),
                        [&s](const auto& entry) { return entry.first == s; });
  }
};

Holds& holds() {
  static auto* h = new Holds();  // leaked: lanes may outlive static destruction
  return *h;
}

void give_back(const std::vector<c10::Stream>& taken) {
  auto& h = holds();
  std::lock_guard<std::mutex> lock(h.mutex);
  for (const auto& s : taken) {
    const auto it = h.find(s);
    if (it != h.counts.end() && --it->second == 0) h.counts.erase(it);
  }
}

}  // namespace

c10::Stream take_pool_stream(c10::Device device, bool high_priority) {
  c10::impl::VirtualGuardImpl impl(device.type());
  auto& h = holds();
  std::lock_guard<std::mutex> lock(h.mutex);
  std::optional<c10::Stream> least;
  int least_holds = 0;
  for (int draw = 0; draw < kPoolDraws; ++draw) {
    const c10::Stream s = impl.getStreamFromGlobalPool(device, high_priority);
    const auto it = h.find(s);
    if (it == h.counts.end()) {
      h.counts.emplace_back(s, 1);
      return s;
    }
    if (!least || it->second < least_holds) {
      least = s;
      least_holds = it->second;
    }
  }
  // gpipe holds every stream of the pool: share the least-held one.
  ++h.find(*least)->second;
  return *least;
}

HeldStreams hold(std::vector<c10::Stream> taken) {
  struct Held {
    std::vector<c10::Stream> streams;
    ~Held() { give_back(streams); }
  };
  auto held = std::make_shared<Held>();  // made in place: no copy gives them back early
  held->streams = std::move(taken);
  return held;
}

int pool_stream_holds(const c10::Stream& stream) {
  auto& h = holds();
  std::lock_guard<std::mutex> lock(h.mutex);
  const auto it = h.find(stream);
  return it == h.counts.end() ? 0 : it->second;
}

SourceStreams::~SourceStreams() { give_back(streams_); }

c10::Stream SourceStreams::on(c10::Device source) {
  std::lock_guard<std::mutex> hold(mutex_);
  for (const auto& s : streams_) {
    if (s.device() == source) return s;
  }
  streams_.push_back(take_pool_stream(source));
  return streams_.back();
}

std::vector<c10::Stream> SourceStreams::all() const {
  std::lock_guard<std::mutex> hold(mutex_);
  return streams_;
}

Lane make_lane(c10::Device device) {
  if (device.is_cpu()) {
    const c10::Stream cpu(c10::Stream::DEFAULT, device);
    return {device, cpu, cpu};
  }
  if (!device.has_index()) {
    device = c10::Device(device.type(), 0);
  }
  const c10::Stream compute = take_pool_stream(device);
  const c10::Stream copy = take_pool_stream(device);
  Lane lane{device, compute, copy};
  lane.held = hold({compute, copy});
  return lane;
}

std::vector<std::shared_ptr<c10::Event>> mark(const c10::Stream& stream) {
  if (stream.device().is_cpu()) return {};
  auto ev = std::make_shared<c10::Event>(stream.device_type());
  ev->record(stream);
  return {std::move(ev)};
}

Payload from_current_streams(Batch batch) {
  Payload payload;
  std::vector<c10::Device> seen;
  for (const auto& t : batch.values) {
    if (!on_accelerator(t)) continue;
    const auto device = t.device();
    if (!add_once(seen, device)) continue;
    c10::impl::VirtualGuardImpl impl(device.type());
    auto events = mark(impl.getStream(device));
    payload.ready.insert(payload.ready.end(), events.begin(), events.end());
  }
  payload.batch = std::move(batch);
  return payload;
}

Batch receive(Payload payload, const Lane& lane, Span* copy) {
  Batch& batch = payload.batch;
  bool any_copy = false;
  for (const auto& t : batch.values) {
    if (t.defined() && t.device() != lane.device) any_copy = true;
  }
  if (lane.device.is_cpu()) {
    // Accelerator -> CPU: wait on the host for the producers, then copy on
    // the source's copy stream (a blocking copy: done when it returns).
    for (const auto& ev : payload.ready) ev->synchronize();
    if (any_copy) {
      if (copy != nullptr) copy->restart();
      for (auto& t : batch.values) {
        if (!on_accelerator(t)) continue;
        c10::StreamGuard on_source(source_stream(lane, t.device()));
        t = moved(t, lane.device, /*non_blocking=*/false);
      }
    }
    return std::move(batch);
  }
  if (any_copy) {
    // The destination is allocated on the copy stream (current while it is
    // made) and recorded on the compute stream below. The copy stream waits
    // for the producers too: values already on this device are covered by
    // the one `done` event that the compute stream waits for.
    c10::StreamGuard on_copy(lane.copy);
    wait_all(payload.ready, lane.copy);
    if (copy != nullptr) copy->restart(lane.copy);
    std::vector<c10::Stream> ordered;  // source copy streams already waiting for `ready`
    for (auto& t : batch.values) {
      if (!t.defined() || t.device() == lane.device) continue;
      if (t.device().is_cpu()) {
        // Host -> device, on lane.copy. From pageable memory the copy has
        // read the source when it returns (CUDA stages it), as the plain
        // model's x.to(device) has; from pinned memory a non-blocking copy
        // would still be reading after the call returns, so a caller
        // refilling its pinned buffer after forward() would race with it:
        // that copy blocks, as x.to(device) does.
        t = moved(t, lane.device, /*non_blocking=*/!t.is_pinned());
        continue;
      }
      // Device -> device: ATen runs it on the source device's current
      // stream, so make the source copy stream current there as well
      // (lane.copy stays current on this device: ATen orders it after the
      // copy). The source is recorded there: its producer may free it
      // meanwhile, and the allocator must not reuse it before the copy ran.
      const c10::Stream source = source_stream(lane, t.device());
      if (add_once(ordered, source)) wait_all(payload.ready, source);
      record_on(t, source);
      c10::StreamGuard on_source(source);
      t = moved(t, lane.device, /*non_blocking=*/true);
    }
    payload.ready = mark(lane.copy);
  }
  wait_all(payload.ready, lane.compute);
  for (const auto& t : batch.values) record_on(t, lane.compute);
  return std::move(batch);
}

Batch settle(Payload payload) {
  // The caller reads each tensor on the current stream of the tensor's
  // device, which need not be the device a ready event was recorded on (a
  // stage's sums of a leaf's grads live on the leaf's device): every such
  // stream waits for every event (a wait on another device's event is legal).
  std::vector<c10::Device> devices;
  for (const auto& ev : payload.ready) add_once(devices, ev->device());
  for (const auto& t : payload.batch.values) {
    if (on_accelerator(t)) add_once(devices, t.device());
  }
  for (const auto& device : devices) {
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream current = impl.getStream(device);
    for (const auto& ev : payload.ready) {
      if (ev->device_type() == device.type()) ev->block(current);
    }
  }
  for (const auto& t : payload.batch.values) {
    if (!on_accelerator(t)) continue;
    c10::impl::VirtualGuardImpl impl(t.device().type());
    record_on(t, impl.getStream(t.device()));
  }
  return std::move(payload.batch);
}

void wait_for_current_streams(const std::vector<const Lane*>& lanes) {
  // One event per device, on the caller's current stream there.
  std::vector<std::pair<c10::Device, c10::Event>> marks;
  auto mark_of = [&marks](c10::Device device) -> const c10::Event& {
    for (const auto& [d, ev] : marks) {
      if (d == device) return ev;
    }
    c10::impl::VirtualGuardImpl impl(device.type());
    c10::Event ev(device.type());
    ev.record(impl.getStream(device));
    marks.emplace_back(device, std::move(ev));
    return marks.back().second;
  };
  for (const Lane* lane : lanes) {
    if (lane == nullptr) continue;
    for (const auto& s : streams_of(*lane)) mark_of(s.device()).block(s);
  }
}

void current_streams_wait_for(const std::vector<const Lane*>& lanes,
                              const std::vector<c10::Device>& also) {
  // One event per stream any lane uses and per current stream on a device in
  // `also`; then the current (and default) stream of every device among
  // them waits for ALL the events, whatever device each was recorded on.
  // Since torch 2.9 autograd hands a grad to a consumer on another device
  // after an event on the producer node's stream (PipeBackward's: the
  // forward-time stream of the output's device), so that stream must come
  // after the lanes on every device, not only on its own (issue 23 item 7):
  //
  //   lane on d0 (compute)  B(0) rec(e0)
  //   lane on d1 (compute)  B(1) rec(e1)
  //   cur(d1) = PipeBackward's stream   wait(e0) wait(e1) rec(done)
  //   consumer of x.grad on d0                          wait(done) ...
  std::vector<c10::Stream> streams;
  for (const Lane* lane : lanes) {
    if (lane == nullptr) continue;
    for (const auto& s : streams_of(*lane)) add_once(streams, s);
  }
  for (const auto& device : also) {
    if (device.is_cpu()) continue;
    c10::impl::VirtualGuardImpl impl(device.type());
    add_once(streams, impl.getStream(device));
  }
  std::vector<c10::Device> devices;
  std::vector<c10::Event> events;
  events.reserve(streams.size());
  for (const auto& s : streams) {
    events.emplace_back(s.device_type());
    events.back().record(s);
    add_once(devices, s.device());
  }
  for (const auto& device : devices) {
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream current = impl.getStream(device);
    std::optional<c10::Stream> fallback;
    try {
      fallback = impl.getDefaultStream(device);
    } catch (const c10::Error&) {
      // A backend without a default stream: only the current one.
    }
    for (size_t e = 0; e < events.size(); ++e) {
      if (streams[e].device_type() != device.type()) continue;
      if (streams[e] != current) events[e].block(current);
      if (fallback && *fallback != current && streams[e] != *fallback) events[e].block(*fallback);
    }
  }
}

void record_on_current_streams(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (!on_accelerator(t)) continue;
    c10::impl::VirtualGuardImpl impl(t.device().type());
    record_on(t, impl.getStream(t.device()));
  }
}

}  // namespace gpipe::detail
