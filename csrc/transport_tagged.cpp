// transport_tagged.cpp — the process-group transport's tagged matching (Gloo): each part of a hand-off on a tag of its own, receives posted early.
//
// See transport_c10d.h ("Tagged") for the wire protocol; the shared
// mechanics (sends, waits, failure) are in transport_c10d.cpp.
#include "transport_c10d.h"

#include "transport_wire.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace gpipe::detail {

using namespace wire;

namespace {

// Small hand-offs travel inside their header: one message instead of two.
// Over Gloo a message costs its latency (a wake-up of the receiver's waiting
// thread, ~0.1-0.3 ms on a busy machine) whatever its size, and a hand-off
// of a few hundred bytes is all latency. Both ends decide from last step's
// shapes, which they share, whether the receiver posts the tensors' receives
// early (only for a batch that did not fit); the sender inlines whenever
// this step's batch fits.

int64_t value_bytes(const ValueMeta& v) {
  int64_t n = static_cast<int64_t>(c10::elementSize(v.dtype));
  for (const int64_t d : v.shape) n *= d;
  return n;
}

// The header's integers for `meta` and its values inline: [meta length,
// meta, the values' bytes in order, padded to whole integers].
size_t inline_ints(const BatchMeta& meta, size_t encoded) {
  int64_t bytes = 0;
  for (const auto& v : meta.values) {
    if (v.defined) bytes += value_bytes(v);
  }
  return 1 + encoded + static_cast<size_t>((bytes + 7) / 8);
}

// `encoded`: the size of encode(meta).
bool fits_inline(const BatchMeta& meta, size_t encoded) {
  return static_cast<int64_t>(inline_ints(meta, encoded)) <= kWireBody;
}
bool fits_inline(const BatchMeta& meta) { return fits_inline(meta, encode(meta).size()); }

}  // namespace

void ProcessGroupTransport::tagged_begin(const Handoffs& handoffs) {
  // Under mutex_: every header receive of the step, and the first window
  // of tensors' receives.
  upcoming_.clear();
  taken_ = 0;
  for (const auto& a : handoffs.receives) {
    const int from = source(a);
    if (from == rank_) continue;
    headers_.emplace(key(a),
                     post_receive(*group_, {at::empty({kWireInts}, at::kLong)}, from,
                                  tag(a, kHeaderPart)));
    upcoming_.push_back(a);
  }
  for (size_t k = 0; k < std::min(kEarlyWindow, upcoming_.size()); ++k) post_early(upcoming_[k]);
}

void ProcessGroupTransport::post_early(const Address& a) {
  const Key k = key(a);
  auto last = received_meta_.find(k);
  if (last == received_meta_.end() || early_.count(k)) return;
  // Last step's batch came inside its header: no tensors to expect (the
  // sender sends them on kExpectedPart only after a batch that did not fit).
  if (gloo_ && fits_inline(last->second)) return;
  early_.emplace(k, post_values(*group_, last->second, source(a), tag(a, kExpectedPart)));
}

void ProcessGroupTransport::tagged_send(const Address& to, int dst, Batch batch) {
  BatchMeta meta = describe(batch);
  batch = wire_values(std::move(batch));
  std::vector<int64_t> ints = encode(meta);
  // Over Gloo the values are on the host here (wire_values).
  const bool inline_now = gloo_ && fits_inline(meta, ints.size());
  if (inline_now) {
    const size_t encoded = ints.size();
    ints.insert(ints.begin(), static_cast<int64_t>(encoded));
    const size_t at = ints.size();
    ints.resize(inline_ints(meta, encoded), 0);
    auto* out = reinterpret_cast<char*>(ints.data() + at);
    for (const auto& value : batch.values) {
      if (!value.defined()) continue;
      const size_t n = value.nbytes();
      if (n > 0) std::memcpy(out, value.const_data_ptr(), n);  // (an empty one may have no data)
      out += n;
    }
  }
  send_wire(ints, inline_now ? kInline : kBatch, dst, tag(to, kHeaderPart));
  // The receiver expects last step's shapes on kExpectedPart when they did
  // not fit inline: filler of those when they changed or this batch is
  // inline, then the tensors (if not inline) on kChangedPart.
  std::vector<Pending> out;
  int data_tag = tag(to, kExpectedPart);
  auto last = sent_meta_.find(key(to));
  const bool expected = last != sent_meta_.end() && !(gloo_ && fits_inline(last->second));
  if (expected && (inline_now || !(last->second == meta))) {
    send_filler(last->second, dst, data_tag, out);
    data_tag = tag(to, kChangedPart);
  }
  sent_meta_[key(to)] = std::move(meta);
  if (!inline_now) send_values(batch, dst, data_tag, out);
  std::lock_guard<std::mutex> hold(mutex_);
  keep_sent(out);
  owed_.erase(key(to));
}

std::optional<Payload> ProcessGroupTransport::tagged_receive(const Address& at, int from) {
  const std::string what = describe_address(at);
  Pending head;
  std::optional<std::vector<Pending>> early;
  {
    std::lock_guard<std::mutex> hold(mutex_);
    auto it = headers_.find(key(at));
    TORCH_INTERNAL_ASSERT(it != headers_.end(), "gpipe: receive at ", what,
                          " was not announced by begin, or taken twice");
    head = std::move(it->second);
    headers_.erase(it);
    reap();
    // The sender sends last step's shapes (or filler) on kExpectedPart:
    // this address's receives must be posted; the window moves on.
    post_early(at);
    auto e = early_.find(key(at));
    if (e != early_.end()) {
      early = std::move(e->second);
      early_.erase(e);
    }
    ++taken_;
    const size_t end = std::min(taken_ + kEarlyWindow, upcoming_.size());
    for (size_t k = taken_; k < end; ++k) post_early(upcoming_[k]);
  }
  if (!wait(head, from, what)) return std::nullopt;
  const auto* w = head.tensors[0].const_data_ptr<int64_t>();
  const int64_t kind = w[0];
  const int64_t length = w[1];
  if ((kind != kBatch && kind != kFailure && kind != kInline) || length < 0) {
    fail_between_ranks("gpipe: rank ", rank_, " got a malformed hand-off header from rank ", from,
                       " for ", what, " (kind ", kind, ", length ", length,
                       "); run the same gpipe version on every rank");
  }
  std::vector<int64_t> ints(w + 2, w + 2 + std::min(length, kWireBody));
  if (length > kWireBody) {
    Pending rest =
        post_receive(*group_, {at::empty({length - kWireBody}, at::kLong)}, from, tag(at, 0));
    if (!wait(rest, from, what)) return std::nullopt;
    const auto* r = rest.tensors[0].const_data_ptr<int64_t>();
    ints.insert(ints.end(), r, r + (length - kWireBody));
  }
  if (kind == kFailure) {
    peer_failure_ = unpack(ints);
    peer_failed(*peer_failure_, from, what);
  }
  // The early receives (last step's shapes): the tensors, or filler.
  std::vector<at::Tensor> got;
  if (early) {
    auto rest = unwaited(*early, [this](Pending p) { drop(std::move(p)); });
    for (auto& p : *early) {
      at::Tensor t = p.tensors[0];
      if (!wait(p, from, what)) return std::nullopt;
      p.work.reset();
      got.push_back(std::move(t));
    }
  }
  BatchMeta meta;
  std::optional<std::vector<at::Tensor>> values;
  if (kind == kInline) {
    const int64_t encoded = ints.empty() ? -1 : ints[0];
    if (encoded < 0 || 1 + encoded > static_cast<int64_t>(ints.size())) {
      fail_between_ranks("gpipe: rank ", rank_, " got a malformed hand-off header from rank ",
                         from, " for ", what, " (inline metadata of ", encoded, " integers in ",
                         ints.size(), "); run the same gpipe version on every rank");
    }
    meta = decode(std::vector<int64_t>(ints.begin() + 1, ints.begin() + 1 + encoded));
    TORCH_CHECK(inline_ints(meta, static_cast<size_t>(encoded)) == ints.size(), "gpipe: rank ",
                rank_, " got a hand-off header from rank ", from, " for ", what, " whose ",
                ints.size(), " integers do not hold its values inline; run the same gpipe "
                "version on every rank");
    const auto* bytes = reinterpret_cast<const char*>(ints.data() + 1 + encoded);
    values.emplace();
    for (const auto& v : meta.values) {
      if (!v.defined) continue;
      at::Tensor t = at::empty(v.shape, at::TensorOptions().dtype(v.dtype));
      if (t.nbytes() > 0) std::memcpy(t.mutable_data_ptr(), bytes, t.nbytes());
      bytes += t.nbytes();
      values->push_back(std::move(t));
    }
  } else {
    meta = decode(ints);
    if (!early) {
      values = receive_values(meta, from, tag(at, kExpectedPart), what);
    } else if (received_meta_.at(key(at)) == meta) {
      // Expected shapes: these are the tensors; else filler, and the tensors follow.
      values = std::move(got);
    } else {
      values = receive_values(meta, from, tag(at, kChangedPart), what);
    }
  }
  if (!values) return std::nullopt;
  Batch batch;
  batch.atomic = meta.atomic;
  size_t next = 0;
  for (const auto& v : meta.values) {
    batch.values.push_back(v.defined ? landed((*values)[next++]) : at::Tensor());
  }
  for (size_t k = 0; k < meta.values.size(); ++k) {
    if (meta.values[k].defined && meta.values[k].requires_grad) batch.values[k].requires_grad_(true);
  }
  {
    std::lock_guard<std::mutex> hold(mutex_);
    received_meta_[key(at)] = std::move(meta);
  }
  return Payload{std::move(batch), {}};
}

std::optional<std::vector<at::Tensor>> ProcessGroupTransport::receive_values(
    const BatchMeta& meta, int from, int tag, const std::string& what) {
  std::vector<Pending> posted = post_values(*group_, meta, from, tag);
  auto rest = unwaited(posted, [this](Pending p) { drop(std::move(p)); });
  std::vector<at::Tensor> out;
  for (auto& p : posted) {
    at::Tensor t = p.tensors[0];
    if (!wait(p, from, what)) return std::nullopt;
    p.work.reset();
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace gpipe::detail
