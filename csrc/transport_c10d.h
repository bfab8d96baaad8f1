// transport_c10d.h — hand-offs between ranks over a c10d process group: a small header, then the tensors, by isend/irecv.
//
// Stage s lives on rank s mod R of an R-rank group. A hand-off to a stage of
// another rank travels as
//
//   header:  int64[kWireInts]  kind, length, encode(describe(batch)) ...   tag(address, 0)
//   tensors: one message per defined value, in order                        tag(address, 1)
//
// so the receiver learns shapes, dtypes and grad flags before it allocates:
// shapes may change from step to step. A hand-off between two stages of the
// same rank (world size 1) stays in-process (Mailboxes). The header receives
// of a whole step are posted when it begins (`begin`): a peer's header send
// never waits for us, and Gloo starts moving it at once.
//
// Shapes rarely change, so the tensors' receives are posted early too, for
// the next few addresses in the order this rank takes them, with the shapes
// the same address had last step (both ends know them): Gloo then moves the
// tensors right behind the header, without waiting for this rank to ask.
// When the header says the shapes changed, the sender has sent filler of
// the old shapes on tag 1 (which the early receives take and drop) and the
// real tensors on tag(address, 2), which the receiver then asks for.
//
// Failure: a rank whose task fails calls `fail`, which sends a failure header
// (origin rank and its message) to every address it still owes; the peer
// waiting there fails with an error naming the origin rank and forwards it in
// turn, so every rank stops within a hand-off of the failure. A peer that
// died surfaces from c10d (connection closed, or the group's timeout) as an
// error naming that rank. After a failed step the group's point-to-point
// state is undefined (unmatched messages may remain): the step's owner
// refuses further steps.
#pragma once

#include "plan.h"
#include "transport.h"

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

/// What this rank receives and sends in one step of `plan` as its worker
/// `worker` (each address once): forward hand-offs between consecutive
/// stages and along the skip `routes`, grads back.
struct Handoffs {
  std::vector<Address> receives;
  std::vector<Address> sends;
};
Handoffs plan_handoffs(const Plan& plan, int64_t worker,
                       const std::vector<SkipRoute>& routes = {});

class ProcessGroupTransport final : public Transport {
 public:
  /// `stages` stages in all over the group's ranks (stage s on rank s mod
  /// size). `reverse`: the same ranks again, for hand-offs to lower ranks
  /// (see Groups::reverse); null: `group`. Received tensors are allocated
  /// on `device` (CPU for Gloo; the rank's GPU for NCCL); the receiving
  /// stage moves them where it runs.
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group,
                        c10::intrusive_ptr<c10d::ProcessGroup> reverse, int64_t stages,
                        c10::Device device = c10::kCPU);
  ~ProcessGroupTransport() override;
  ProcessGroupTransport(const ProcessGroupTransport&) = delete;
  ProcessGroupTransport& operator=(const ProcessGroupTransport&) = delete;

  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return size_; }
  int owner(int64_t stage) const noexcept { return static_cast<int>(stage % size_); }
  /// The rank that sends to `at`: the previous stage's for activations,
  /// the next stage's for grads, the other end of its route for a skip or
  /// its grad.
  int source(const Address& at) const;

  /// Starts a step of `microbatches` micro-batches with skip `routes` in
  /// which this rank receives and sends `handoffs`: posts every header
  /// receive now.
  void begin(int64_t microbatches, const Handoffs& handoffs,
             std::vector<SkipRoute> routes = {});
  void send(const Address& to, Payload payload) override;
  std::optional<Payload> receive(const Address& at) override;
  void cancel() override;
  bool cancelled() const override { return cancelled_.load(); }
  /// Ends a step that ran through: waits until every peer took what this
  /// rank sent (the group's timeout bounds it).
  void finish();
  /// Ends a failed step: every address this rank still owes gets a failure
  /// header saying so (`what`, or the failure of the peer that stopped
  /// this rank, whose rank it keeps), then drops whatever is in flight.
  void fail(const std::string& what);

 private:
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<at::Tensor> tensors;
  };
  using Key = std::tuple<int64_t, int, int64_t, int64_t>;
  static Key key(const Address& a) {
    const bool skip = a.flow == Flow::Skip || a.flow == Flow::SkipGrad;
    return {a.stage, static_cast<int>(a.flow), a.microbatch, skip ? a.route : 0};
  }
  int tag(const Address& a, int part) const;
  Pending post_receive(std::vector<at::Tensor> tensors, int from, int tag);
  /// Posts the tensors' receives of `a` with last step's shapes, once (under mutex_).
  void post_early(const Address& a);
  /// Receives `meta`'s defined values from `from` on `tag`.
  std::optional<std::vector<at::Tensor>> receive_values(const BatchMeta& meta, int from, int tag,
                                                        const std::string& what);
  /// Waits for `work`; false when cancelled. Errors name `from` and `what`.
  bool wait(Pending& pending, int from, const std::string& what);
  void send_wire(const std::vector<int64_t>& ints, int64_t kind, int to, int tag);
  std::string describe_address(const Address& a) const;
  /// Keeps `pending` alive for the life of the process (see fail()).
  static void bury(Pending pending);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::ProcessGroup> reverse_;
  int rank_;
  int size_;
  int64_t stages_;
  c10::Device device_;
  bool gloo_;
  int64_t microbatches_ = 0;
  std::vector<SkipRoute> routes_;
  std::optional<Mailboxes> local_;

  std::mutex mutex_;
  std::map<Key, Pending> headers_;   // posted header receives not yet taken
  std::vector<Pending> waiting_;     // receives being waited on (cancel aborts them)
  std::vector<Pending> sent_works_;  // sends not yet known to be taken
  std::set<Key> owed_;               // addresses this step sends to, not yet sent
  // Last step's metadata per address, as sent and as received (the same
  // when both ends ran it): the shapes of the early receives.
  std::map<Key, BatchMeta> sent_meta_;
  std::map<Key, BatchMeta> received_meta_;
  std::map<Key, std::vector<Pending>> early_;  // tensors' receives posted early
  std::vector<Address> upcoming_;              // this step's remote receives, in order
  size_t taken_ = 0;                           // how many of them were received
  std::atomic<bool> cancelled_{false};
  // The failure a peer announced: its rank and message.
  std::optional<std::pair<int64_t, std::string>> peer_failure_;
};

}  // namespace gpipe::detail
