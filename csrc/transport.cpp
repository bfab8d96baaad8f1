// transport.cpp — batch metadata and its header encoding; the in-process mailboxes.
#include "transport.h"

#include "check.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <thread>

namespace gpipe::detail {

namespace {

// How long a receiver spins for its input before it parks: about what
// parking and waking a thread costs on a VM (futex, context switches).
constexpr std::chrono::microseconds kSpin{50};

// Header layout: [version, atomic, count, then per value: defined, dtype,
// device type, device index, requires_grad, rank, sizes...].
constexpr int64_t kHeaderVersion = 1;

}  // namespace

BatchMeta describe(const Batch& batch) {
  BatchMeta meta;
  meta.atomic = batch.atomic;
  meta.values.reserve(batch.size());
  for (const auto& t : batch.values) {
    ValueMeta v;
    v.defined = t.defined();
    if (v.defined) {
      v.dtype = t.scalar_type();
      v.shape = t.sizes().vec();
      v.device = t.device();
      v.requires_grad = t.requires_grad();
    }
    meta.values.push_back(std::move(v));
  }
  return meta;
}

std::vector<int64_t> encode(const BatchMeta& meta) {
  std::vector<int64_t> h{kHeaderVersion, meta.atomic ? 1 : 0,
                         static_cast<int64_t>(meta.values.size())};
  for (const auto& v : meta.values) {
    h.push_back(v.defined ? 1 : 0);
    h.push_back(static_cast<int64_t>(v.dtype));
    h.push_back(static_cast<int64_t>(v.device.type()));
    h.push_back(v.device.index());
    h.push_back(v.requires_grad ? 1 : 0);
    h.push_back(static_cast<int64_t>(v.shape.size()));
    h.insert(h.end(), v.shape.begin(), v.shape.end());
  }
  return h;
}

BatchMeta decode(const std::vector<int64_t>& header) {
  size_t at = 0;
  auto next = [&](const char* what) {
    TORCH_CHECK(at < header.size(), "gpipe: hand-off header of ", header.size(),
                " integers ends before its ", what);
    return header[at++];
  };
  const int64_t version = next("version");
  TORCH_CHECK(version == kHeaderVersion, "gpipe: hand-off header version ", version,
              " but this build reads version ", kHeaderVersion,
              "; run the same gpipe on every process");
  BatchMeta meta;
  meta.atomic = next("batch flag") != 0;
  const int64_t count = next("value count");
  TORCH_CHECK(count >= 0, "gpipe: hand-off header announces ", count, " values");
  for (int64_t k = 0; k < count; ++k) {
    ValueMeta v;
    v.defined = next("defined flag") != 0;
    v.dtype = static_cast<c10::ScalarType>(next("dtype"));
    const auto type = static_cast<c10::DeviceType>(next("device type"));
    const auto index = static_cast<c10::DeviceIndex>(next("device index"));
    v.device = c10::Device(type, index);
    v.requires_grad = next("grad flag") != 0;
    const int64_t rank = next("rank");
    TORCH_CHECK(rank >= 0, "gpipe: hand-off header announces rank ", rank);
    for (int64_t d = 0; d < rank; ++d) v.shape.push_back(next("sizes"));
    meta.values.push_back(std::move(v));
  }
  TORCH_CHECK(at == header.size(), "gpipe: hand-off header has ", header.size() - at,
              " integers past its last value");
  return meta;
}

Mailboxes::Mailboxes(int64_t stages, int64_t microbatches, int64_t routes)
    : stages_(stages),
      microbatches_(microbatches),
      routes_(routes),
      slots_(static_cast<size_t>((stages + routes) * 2 * microbatches)),
      boxes_(static_cast<size_t>(stages)) {}

Mailboxes::Slot& Mailboxes::slot(const Address& a) {
  TORCH_INTERNAL_ASSERT(a.stage >= 0 && a.stage < stages_ && a.microbatch >= 0 &&
                        a.microbatch < microbatches_);
  // Activations and grads by stage, then skips and their grads by route.
  int64_t row = 0;
  switch (a.flow) {
    case Flow::Activation:
    case Flow::Grad:
      row = a.stage * 2 + static_cast<int64_t>(a.flow);
      break;
    case Flow::Skip:
    case Flow::SkipGrad:
      TORCH_INTERNAL_ASSERT(a.route >= 0 && a.route < routes_);
      row = (stages_ + a.route) * 2 + (a.flow == Flow::Skip ? 0 : 1);
      break;
  }
  return slots_[static_cast<size_t>(row * microbatches_ + a.microbatch)];
}

void Mailboxes::send(const Address& to, Payload payload) {
  auto& box = boxes_[static_cast<size_t>(to.stage)];
  auto& s = slot(to);
  TORCH_INTERNAL_ASSERT(!s.full.load(), "gpipe: two hand-offs to the same address");
  s.payload = std::move(payload);
  // seq_cst pairs with the parking receiver's increment of `parked` and its
  // check of `full`: either it sees the payload or we see it parked.
  s.full.store(true);
  if (box.parked.load() > 0) {
    // Taking the mutex orders the store before the receiver's wait.
    { std::lock_guard<std::mutex> hold(box.mutex); }
    box.arrived.notify_all();
  }
}

std::optional<Payload> Mailboxes::receive(const Address& at) {
  auto& box = boxes_[static_cast<size_t>(at.stage)];
  auto& s = slot(at);
  auto arrived = [&] { return s.full.load() || cancelled_.load(); };
  if (!arrived()) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (!arrived() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  }
  if (!arrived()) {
    std::unique_lock<std::mutex> hold(box.mutex);
    box.parked.fetch_add(1);
    box.arrived.wait(hold, arrived);
    box.parked.fetch_sub(1);
  }
  if (!s.full.load()) return std::nullopt;
  s.full.store(false);
  return std::move(s.payload);
}

void Mailboxes::cancel() {
  cancelled_.store(true);
  for (auto& box : boxes_) {
    // Taking the mutex orders the flag before any waiter's next check.
    { std::lock_guard<std::mutex> hold(box.mutex); }
    box.arrived.notify_all();
  }
}

}  // namespace gpipe::detail
