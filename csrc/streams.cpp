// streams.cpp — device-generic streams and events (c10 virtual guards), so one build serves CPU and CUDA torch.
#include "streams.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <ATen/core/grad_mode.h>

#include <algorithm>

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

}  // namespace

Lane make_lane(c10::Device device) {
  if (device.is_cpu()) {
    const c10::Stream cpu(c10::Stream::DEFAULT, device);
    return {device, cpu, cpu};
  }
  if (!device.has_index()) {
    device = c10::Device(device.type(), 0);
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  return {device, impl.getStreamFromGlobalPool(device), impl.getStreamFromGlobalPool(device)};
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
    if (std::find(seen.begin(), seen.end(), device) != seen.end()) continue;
    seen.push_back(device);
    c10::impl::VirtualGuardImpl impl(device.type());
    auto events = mark(impl.getStream(device));
    payload.ready.insert(payload.ready.end(), events.begin(), events.end());
  }
  payload.batch = std::move(batch);
  return payload;
}

Batch receive(Payload payload, const Lane& lane) {
  Batch& batch = payload.batch;
  bool any_copy = false;
  for (const auto& t : batch.values) {
    if (t.defined() && t.device() != lane.device) any_copy = true;
  }
  if (lane.device.is_cpu()) {
    // Accelerator -> CPU: wait on the host for the producer, then copy.
    for (const auto& ev : payload.ready) ev->synchronize();
    if (any_copy) {
      for (auto& t : batch.values) {
        if (t.defined() && !t.device().is_cpu()) t = moved(t, lane.device, false);
      }
    }
    return std::move(batch);
  }
  if (any_copy) {
    // Copies run on the copy stream once the producer is done; the source is
    // recorded there (the producer may free it meanwhile), the destination
    // was allocated there and is recorded on the compute stream below.
    c10::StreamGuard on_copy(lane.copy);
    wait_all(payload.ready, lane.copy);
    for (auto& t : batch.values) {
      if (!t.defined() || t.device() == lane.device) continue;
      record_on(t, lane.copy);
      t = moved(t, lane.device, /*non_blocking=*/true);
    }
    payload.ready = mark(lane.copy);
  }
  wait_all(payload.ready, lane.compute);
  for (const auto& t : batch.values) record_on(t, lane.compute);
  return std::move(batch);
}

Batch settle(Payload payload) {
  for (const auto& ev : payload.ready) {
    c10::impl::VirtualGuardImpl impl(ev->device_type());
    ev->block(impl.getStream(ev->device()));
  }
  for (const auto& t : payload.batch.values) {
    if (!on_accelerator(t)) continue;
    c10::impl::VirtualGuardImpl impl(t.device().type());
    record_on(t, impl.getStream(t.device()));
  }
  return std::move(payload.batch);
}

}  // namespace gpipe::detail
