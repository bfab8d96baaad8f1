// transport_tagged.cpp — the process-group transport's tagged matching (Gloo): each part of a hand-off on a tag of its own, receives posted early.
//
// See transport_c10d.h ("Tagged") for the wire protocol; the shared
// mechanics (sends, waits, failure) are in transport_c10d.cpp.
#include "transport_c10d.h"

#include "transport_wire.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace gpipe::detail {

using namespace wire;

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
  early_.emplace(k, post_values(*group_, last->second, source(a), tag(a, kExpectedPart)));
}

void ProcessGroupTransport::tagged_send(const Address& to, int dst, Batch batch) {
  BatchMeta meta = describe(batch);
  batch = wire_values(std::move(batch));
  send_wire(encode(meta), kBatch, dst, tag(to, kHeaderPart));
  // The receiver expects last step's shapes on kExpectedPart: filler of
  // those when they changed, the tensors on kChangedPart.
  std::vector<Pending> out;
  int data_tag = tag(to, kExpectedPart);
  auto last = sent_meta_.find(key(to));
  if (last != sent_meta_.end() && !(last->second == meta)) {
    send_filler(last->second, dst, data_tag, out);
    data_tag = tag(to, kChangedPart);
  }
  sent_meta_[key(to)] = std::move(meta);
  send_values(batch, dst, data_tag, out);
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
  if ((kind != kBatch && kind != kFailure) || length < 0) {
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
  BatchMeta meta = decode(ints);
  std::optional<std::vector<at::Tensor>> values;
  if (!early) {
    values = receive_values(meta, from, tag(at, kExpectedPart), what);
  } else {
    auto rest = unwaited(*early, [this](Pending p) { drop(std::move(p)); });
    std::vector<at::Tensor> got;
    for (auto& p : *early) {
      at::Tensor t = p.tensors[0];
      if (!wait(p, from, what)) return std::nullopt;
      p.work.reset();
      got.push_back(std::move(t));
    }
    // Expected shapes: these are the tensors; else filler, and the tensors follow.
    if (received_meta_.at(key(at)) == meta) {
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
