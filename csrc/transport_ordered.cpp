// transport_ordered.cpp — the process-group transport's ordered matching (NCCL): one channel per sending peer, read in its send order.
//
// See transport_c10d.h ("Ordered") for the wire protocol; the shared
// mechanics (sends, waits, failure) are in transport_c10d.cpp.
#include "transport_c10d.h"

#include "check.h"
#include "transport_wire.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>
#include <string>

namespace gpipe::detail {

using namespace wire;

void ProcessGroupTransport::drop_channels() {
  // Under mutex_: receives posted for messages that will not come (or
  // come late) are buried, not freed.
  for (auto& [from, channel] : channels_) {
    if (channel.header) drop(std::move(*channel.header));
    for (auto& p : channel.predicted) drop(std::move(p));
  }
  channels_.clear();
  inbox_.clear();
}

c10d::ProcessGroup& ProcessGroupTransport::lane_group(int from, int to) const {
  return from < to ? *group_ : *reverse_;
}

void ProcessGroupTransport::connect() {
  // NCCL connects a pair at its first message, blocking both ends until
  // the other one comes: a receive posted early to one peer could then
  // wait for a peer that waits on another pair. So the first step connects
  // every pair that will talk, on both groups, one pair after the other in
  // one order all ranks share (the earliest unfinished pair always has
  // both its ranks at it).
  std::set<std::pair<int, int>> pairs;
  auto talk = [&](int64_t from, int64_t to) {
    const int a = owner(from);
    const int b = owner(to);
    if (a != b) pairs.insert({std::min(a, b), std::max(a, b)});
  };
  for (int64_t s = 0; s + 1 < stages_; ++s) talk(s, s + 1);
  for (const auto& route : routes_) talk(route.from, route.to);
  for (const bool up : {true, false}) {
    for (const auto& [low, high] : pairs) {
      if (low != rank_ && high != rank_) continue;
      // Each group carries one way: the pipeline group up, the reverse one down.
      const int from = up ? low : high;
      const int to = up ? high : low;
      std::vector<Pending> out;
      if (from == rank_) {
        send_tensor(at::zeros({1}, at::kLong), to, 0, out);
      } else {
        out.push_back(post_receive(lane_group(from, to), {wire_tensor(1)}, from, 0));
      }
      const int peer = from == rank_ ? to : from;
      TORCH_CHECK(wait(out[0], peer, "the first message between ranks " + std::to_string(from) +
                                         " and " + std::to_string(to)),
                  "gpipe: rank ", rank_, " was cancelled while connecting to rank ", peer);
    }
  }
}

void ProcessGroupTransport::ordered_begin(const Handoffs& handoffs) {
  // Under mutex_. Each sending peer's channel carries exactly the hand-offs
  // this rank receives from it this step, in the peer's order.
  TORCH_INTERNAL_ASSERT(inbox_.empty());
  channels_.clear();
  sent_count_.clear();
  for (const auto& a : handoffs.receives) {
    const int from = source(a);
    if (from != rank_) ++channels_[from].expected;
  }
  for (auto& [from, channel] : channels_) post_next(from, channel);
}

void ProcessGroupTransport::post_next(int from, Channel& channel) {
  auto& group = lane_group(from, rank_);
  channel.header = post_receive(group, {wire_tensor(kWireInts)}, from, 0);
  channel.predicted.clear();
  auto last = received_order_meta_.find({from, channel.taken});
  channel.has_prediction = last != received_order_meta_.end();
  if (channel.has_prediction) channel.predicted = post_values(group, last->second, from, 0);
}

void ProcessGroupTransport::ordered_send(const Address& to, int dst, Batch batch) {
  BatchMeta meta = describe(batch);
  batch = wire_values(std::move(batch));
  std::vector<int64_t> ints{to.stage, static_cast<int64_t>(to.flow), to.microbatch, to.route};
  const auto encoded = encode(meta);
  ints.insert(ints.end(), encoded.begin(), encoded.end());
  auto [head, rest] = wire_parts(ints, kBatch);
  int64_t k = 0;
  std::optional<BatchMeta> predicted;
  {
    std::lock_guard<std::mutex> hold(mutex_);
    k = sent_count_[dst]++;
    auto last = sent_order_meta_.find({dst, k});
    if (last != sent_order_meta_.end()) predicted = last->second;
  }
  // The receiver posted the header and the predicted shapes already (see
  // the top of this file): header, predicted (tensors, or filler), rest,
  // then the tensors when the prediction did not hold.
  std::vector<Pending> out;
  send_tensor(head, dst, 0, out);
  const bool hit = predicted && *predicted == meta;
  if (hit) {
    send_values(batch, dst, 0, out);
  } else if (predicted) {
    send_filler(*predicted, dst, 0, out);
  }
  if (rest.defined()) send_tensor(rest, dst, 0, out);
  if (!hit) send_values(batch, dst, 0, out);
  std::lock_guard<std::mutex> hold(mutex_);
  sent_order_meta_[{dst, k}] = std::move(meta);
  keep_sent(out);
  owed_.erase(key(to));
}

std::optional<Payload> ProcessGroupTransport::ordered_receive(const Address& at, int from) {
  const std::string what = describe_address(at);
  while (true) {
    Channel* channel = nullptr;
    {
      std::lock_guard<std::mutex> hold(mutex_);
      reap();
      auto got = inbox_.find(key(at));
      if (got != inbox_.end()) {
        Payload payload = std::move(got->second);
        inbox_.erase(got);
        return payload;
      }
      auto it = channels_.find(from);
      TORCH_INTERNAL_ASSERT(it != channels_.end() && it->second.taken < it->second.expected,
                            "gpipe: receive at ", what, " from rank ", from,
                            " was not announced by begin, or taken twice");
      channel = &it->second;
    }
    // One worker reads a channel; messages for other addresses wait in the inbox.
    if (!read_next(from, *channel, what)) return std::nullopt;
  }
}

bool ProcessGroupTransport::read_next(int from, Channel& channel, const std::string& what) {
  auto& group = lane_group(from, rank_);
  if (channel.failure) peer_failed(*channel.failure, from, what);
  // Receives on an accelerator wait on the side stream; the payload
  // carries its event to the stage that takes it.
  std::optional<c10::StreamGuard> on_side;
  if (side_) on_side.emplace(*side_);
  Pending head = std::move(*channel.header);
  channel.header.reset();
  std::vector<Pending> predicted = std::move(channel.predicted);
  channel.predicted.clear();
  auto unused = unwaited(predicted, [this](Pending p) { drop(std::move(p)); });
  if (!wait(head, from, what, /*on_host=*/true)) return false;
  at::Tensor wire = head.tensors[0].device().is_cpu() ? head.tensors[0] : head.tensors[0].cpu();
  const auto* w = wire.const_data_ptr<int64_t>();
  const int64_t kind = w[0];
  const int64_t length = w[1];
  if ((kind != kBatch && kind != kFailure) || length < 0 ||
      (kind == kBatch && length < 4 + 3)) {
    fail_between_ranks("gpipe: rank ", rank_, " got a malformed hand-off header from rank ", from,
                       " while waiting for ", what, " (kind ", kind, ", length ", length,
                       "); run the same gpipe version on every rank");
  }
  std::vector<int64_t> ints(w + 2, w + 2 + std::min(length, kWireBody));
  if (kind == kFailure) {
    channel.failure = unpack(ints);
    peer_failure_ = channel.failure;
    peer_failed(*channel.failure, from, what);
  }
  const int64_t k = channel.taken;
  if (length > kWireBody) {
    // The rest of the header comes after the predicted tensors.
    Pending rest = post_receive(group, {wire_tensor(length - kWireBody)}, from, 0);
    if (!wait(rest, from, what, /*on_host=*/true)) return false;
    at::Tensor r = rest.tensors[0].device().is_cpu() ? rest.tensors[0] : rest.tensors[0].cpu();
    const auto* rp = r.const_data_ptr<int64_t>();
    ints.insert(ints.end(), rp, rp + (length - kWireBody));
  }
  const Address a{ints[0], static_cast<Flow>(ints[1]), ints[2], ints[3]};
  BatchMeta meta = decode(std::vector<int64_t>(ints.begin() + 4, ints.end()));
  const bool hit = channel.has_prediction && received_order_meta_.at({from, k}) == meta;
  std::vector<Pending> values;
  if (hit) {
    values = std::move(predicted);
    predicted.clear();
  } else {
    // The predicted receives took filler (or nothing was predicted): the
    // tensors follow.
    values = post_values(group, meta, from, 0);
  }
  auto pending = unwaited(values, [this](Pending p) { drop(std::move(p)); });
  {
    std::lock_guard<std::mutex> hold(mutex_);
    received_order_meta_[{from, k}] = meta;
    ++channel.taken;
    // The next message's receives go in right behind this one's.
    if (channel.taken < channel.expected) post_next(from, channel);
  }
  for (auto& p : predicted) {
    // Filler: taken and dropped.
    if (!wait(p, from, what, /*on_host=*/false)) return false;
    p.work.reset();
  }
  Batch batch;
  batch.atomic = meta.atomic;
  size_t next = 0;
  for (const auto& v : meta.values) {
    if (!v.defined) {
      batch.values.emplace_back();
      continue;
    }
    Pending& p = values[next++];
    at::Tensor t = p.tensors[0];
    if (!wait(p, from, what, /*on_host=*/false)) return false;
    p.work.reset();
    t = landed(std::move(t));
    if (v.requires_grad) t.requires_grad_(true);
    batch.values.push_back(std::move(t));
  }
  Payload payload{std::move(batch), side_ ? mark(*side_) : std::vector<std::shared_ptr<c10::Event>>{}};
  std::lock_guard<std::mutex> hold(mutex_);
  TORCH_INTERNAL_ASSERT(!inbox_.count(key(a)), "gpipe: rank ", from, " sent ",
                        describe_address(a), " twice");
  inbox_.emplace(key(a), std::move(payload));
  return true;
}

}  // namespace gpipe::detail
