// transport_c10d.h — hand-offs between ranks over a c10d process group: a small header, then the tensors, by isend/irecv.
//
// Stage s lives on rank s mod R of an R-rank group, or, under ZB-V, in a V
// (rank r holds stages r and 2R-1-r: plan.h, v_placement). A hand-off
// between two stages of the same rank stays in-process (Mailboxes); one
// to another rank travels as a small header (shapes, dtypes and grad flags:
// the receiver allocates from it, so shapes may change from step to step)
// and then the tensors. Two ways to match them, by the backend:
//
// Tagged (Gloo). Each part has its own tag from the address:
//
//   header:  int64[kWireInts]  kind, length, encode(describe(batch)) ...   tag(address, 0)
//   tensors: one message per defined value, in order                        tag(address, 1)
//
// The header receives of a whole step are posted when it begins (`begin`):
// a peer's header send never waits for us, and Gloo starts moving it at
// once. Shapes rarely change, so the tensors' receives are posted early
// too, for the next few addresses in the order this rank takes them, with
// the shapes the same address had last step (both ends know them): Gloo
// then moves the tensors right behind the header, without waiting for this
// rank to ask. When the header says the shapes changed, the sender has sent
// filler of the old shapes on tag 1 (which the early receives take and
// drop) and the real tensors on tag(address, 2), which the receiver then
// asks for. A batch small enough travels inside its header (kind kInline:
// [meta length, meta, the values' bytes]), one message instead of two;
// where last step's batch was inline the receiver posts no early tensor
// receives, and where it was not but this one is, the sender sends filler
// for them (transport_tagged.cpp).
//
// Ordered (NCCL, and any backend but Gloo; GPIPE_HANDOFFS=ordered|tagged
// overrides). NCCL ignores tags: a pair's messages match in the order they
// were posted, and it runs a pair's sends and receives on one in-order
// queue. So every peer that sends to this rank is a channel, read in the
// peer's send order; hand-offs to a higher rank go over the pipeline group,
// to a lower rank over the reverse group (Groups::reverse), so no queue
// holds both directions and a posted receive never blocks a send. The k-th
// message of a channel in a step is
//
//   header:     int64[kWireInts]  kind, length, address, encode(meta) ...
//   predicted:  the values with the shapes message k had last step (both
//               ends know them): the tensors, or filler when they changed
//   rest:       the header's integers past kWireInts - 2, if any
//   tensors:    when there was no prediction or it failed
//
// so the receiver posts the header and the predicted tensors of message k
// + 1 as soon as it has read message k's header: the tensors then move
// right behind the header. A message for an address nobody asked for yet
// waits in an inbox. On a GPU the receives run on a side stream; the
// payload carries its ready event (streams.h), and only the header is
// read on the host (polled, so a cancel still wakes the wait). NCCL
// connects a pair at its first message, blocking both ends: the first step
// first connects every pair that will talk, in one order all ranks share
// (`connect`). Each channel has a queue of its own only where NCCL gives
// each pair its own communicator (its default, lazy connection); a group
// bound to a device at init (eager) runs all of its point-to-point
// messages on one queue, which serializes the hand-offs.
//
// Sends: a send's tensors (and its work) are kept until the send is known
// to be taken, then released at once, not at the end of the step: 1F1B
// holds only K micro-batches' activations on a stage, and sends kept until
// `finish` would keep all M alive on every sending rank. How a send becomes
// known to be taken depends on the backend. Gloo's send works report
// completion only to a wait (isCompleted() stays false until then, and a
// wait that times out fails the whole group, so it cannot be polled): a
// thread of this transport (the reaper) waits for each send in turn and
// drops it when done. Other backends (NCCL) report completion without a
// wait: completed sends are dropped whenever a send is queued or a receive
// asked for. A send that failed, or is still in flight, stays until
// `finish` (which waits for the rest and reports a failed send) or `fail`.
//
// Sends leave the worker at once: `send` queues the hand-off for a thread of
// this transport (the sender), which settles it (waits for its ready events
// on its own current stream), then posts its header and tensors, in the
// order the workers sent them. The worker goes on to its next task while
// the backend's send calls run (on Gloo ~0.1 ms each, the worker's own time
// before). A send that fails cancels the step's waits at once (the workers
// stop) and `finish` reports it; `fail` drops what is still queued (its
// addresses get failure headers). GPIPE_ASYNC_SENDS=0 sends on the worker
// instead.
//
// Failure: a rank whose task fails calls `fail`, which sends a failure header
// (origin rank and its message) to every address it still owes (ordered: to
// every rank it still owes a message); the peer
// waiting there fails with an error naming the origin rank and forwards it in
// turn, so every rank stops within a hand-off of the failure. A peer that
// died surfaces from c10d (connection closed, or the group's timeout) as an
// error naming that rank. After a failed step the group's point-to-point
// state is undefined (unmatched messages may remain): the step's owner
// refuses further steps.
//
// Waits and aborts, by backend. Gloo's works block a wait and say they are
// done only to one; an abort ends that one op (its wait returns false). So
// on Gloo a receive blocks in wait() and `cancel` aborts it. NCCL's works
// are the other way round: wait() only orders the current stream after the
// op (the host does not block), isCompleted() says when the GPU is done,
// and abort() is ncclCommAbort: it tears the whole communicator down, and
// torch's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3) then ends
// the process, maybe before this rank's failure headers reach its peers,
// which would wait out the group's timeout. So on every backend but Gloo
// (`abortable_` false) nothing is ever aborted: the host polls
// isCompleted() (a cancel and step_timeout end the poll), an op left
// unwaited is buried with its buffer (a late message may still land in
// it), and `finish` polls the sends the same way. The bound: step_timeout,
// or when that is zero the group's own timeout, which NCCL's watchdog
// enforces too (and may act on first, ending the process: set step_timeout
// below it to get gpipe's error naming the rank instead). After a failed
// step over NCCL, receives that nobody will match may stay posted on the
// pair communicators: destroy the process group
// (torch.distributed.destroy_process_group()) or end the process before
// using it again.
//
// Files: transport_c10d.cpp (what both modes share), transport_tagged.cpp,
// transport_ordered.cpp, and transport_wire.h (the header's layout, theirs
// alone).
#pragma once

#include "plan.h"
#include "transport.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
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
  /// `stages` stages in all over the group's ranks: stage s on rank
  /// `placement[s]`, or s mod size when `placement` is empty (a loop).
  /// `reverse`: the same ranks again, for hand-offs to lower ranks (see
  /// Groups::reverse); null: `group`. Received tensors are allocated on
  /// `device` (CPU for Gloo; the rank's GPU for NCCL); the receiving stage
  /// moves them where it runs.
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group,
                        c10::intrusive_ptr<c10d::ProcessGroup> reverse, int64_t stages,
                        c10::Device device = c10::kCPU, std::vector<int64_t> placement = {});
  ~ProcessGroupTransport() override;
  ProcessGroupTransport(const ProcessGroupTransport&) = delete;
  ProcessGroupTransport& operator=(const ProcessGroupTransport&) = delete;

  int rank() const noexcept { return rank_; }
  /// The pipeline's group (hand-offs to higher ranks).
  c10d::ProcessGroup& group() const noexcept { return *group_; }
  /// Where the backend moves values: the device, or the host over Gloo.
  c10::Device wire_device() const;
  /// Whether hand-offs match by order (NCCL) rather than by tag (Gloo).
  bool ordered() const noexcept { return ordered_; }
  int ranks() const noexcept { return size_; }
  /// The rank that runs stage `stage`.
  int owner(int64_t stage) const noexcept {
    return static_cast<int>(placement_.empty() ? stage % size_
                                               : placement_[static_cast<size_t>(stage)]);
  }
  /// The stages rank `rank` runs, in ascending order.
  std::vector<int64_t> stages_of(int rank) const;
  /// Whether the stages lie in ZB-V's V (else a loop).
  bool v_placed() const noexcept { return !placement_.empty(); }
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
  /// rank sent (step_timeout bounds it, else the group's timeout); throws,
  /// naming this rank, if a send failed or the time ran out.
  void finish();
  /// A receive (or a wait for a send to be taken) that is still waiting
  /// after `timeout` fails the step, naming what it waited for, the rank
  /// that owes it and the schedule action it holds up. Zero (the default):
  /// the process group's own timeout bounds the wait.
  void set_step_timeout(std::chrono::milliseconds timeout) {
    step_timeout_ms_.store(timeout.count());
  }
  std::chrono::milliseconds step_timeout() const {
    return std::chrono::milliseconds(step_timeout_ms_.load());
  }
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
  Pending post_receive(c10d::ProcessGroup& group, std::vector<at::Tensor> tensors, int from,
                       int tag);
  /// Posts one receive per defined value of `meta`, on wire_device().
  std::vector<Pending> post_values(c10d::ProcessGroup& group, const BatchMeta& meta, int from,
                                   int tag);
  /// Posts the tensors' receives of `a` with last step's shapes, once (under mutex_).
  void post_early(const Address& a);
  /// Receives `meta`'s defined values from `from` on `tag`.
  std::optional<std::vector<at::Tensor>> receive_values(const BatchMeta& meta, int from, int tag,
                                                        const std::string& what);
  /// Waits for `work`; false when cancelled. Errors name `from` and `what`.
  /// `on_host`: the host reads the result (on a GPU: polls until it landed).
  bool wait(Pending& pending, int from, const std::string& what, bool on_host = true);
  /// Sends `batch`'s defined values; filler of `expected`'s shapes.
  void send_values(const Batch& batch, int dst, int tag, std::vector<Pending>& out);
  void send_filler(const BatchMeta& expected, int dst, int tag, std::vector<Pending>& out);
  /// Throws the error of a peer's announced failure (origin rank, message).
  [[noreturn]] void peer_failed(const std::pair<int64_t, std::string>& failure, int from,
                                const std::string& what) const;
  void send_wire(const std::vector<int64_t>& ints, int64_t kind, int to, int tag);
  std::string describe_address(const Address& a) const;
  /// Keeps `pending` alive for the life of the process (see fail()).
  static void bury(Pending pending);
  /// Ends `pending` unwaited: aborts it where an abort ends only that op
  /// (Gloo), never elsewhere (NCCL's tears the communicator down), then
  /// buries it.
  void drop(Pending pending) const;
  /// How long a host poll may wait (backends that do not block on wait):
  /// step_timeout, else the group's timeout; zero: unbounded.
  std::chrono::milliseconds poll_limit() const;
  /// What bounds a wait, for errors: "the pipe's step_timeout", or the group's.
  const char* limit_name() const;
  enum class Polled { Done, Cancelled, OutOfTime };
  /// Polls `work` until it completed, the step is cancelled (when
  /// `cancellable`) or poll_limit() ran out. Only where !abortable_: Gloo's
  /// isCompleted() stays false until a wait, so this would never end there.
  Polled poll(c10d::Work& work, bool cancellable) const;
  /// Queues `out`'s sends in sent_works_ (under mutex_), after reap().
  void keep_sent(std::vector<Pending>& out);
  /// Without a reaper: drops the sends that completed successfully (under mutex_).
  void reap();
  /// The reaper's loop (Gloo): waits for sent_works_' front, drops it once taken.
  void reap_in_order();
  /// Settles `payload` and posts its header and tensors to `dst` (tagged or
  /// ordered); on the sender, or on the worker without one.
  void deliver(const Address& to, int dst, Payload payload);
  /// The sender's loop: delivers outgoing_ in order; on an error, keeps it
  /// in sender_error_ and cancels the step.
  void send_in_order();
  /// Waits until the sender delivered everything queued; throws, naming
  /// this rank, if a delivery failed.
  void drain_sends();
  /// Drops what is queued and waits for a delivery under way (fail()).
  void drop_sends();
  void stop_sender();
  /// Ends the reaper's wait (not the send) and joins it.
  void stop_reaper();

  // The tagged mode (transport_tagged.cpp; see the top of this file):
  // under mutex_, posts the step's header receives and the first window of
  // early tensors' receives.
  void tagged_begin(const Handoffs& handoffs);
  void tagged_send(const Address& to, int dst, Batch batch);
  std::optional<Payload> tagged_receive(const Address& at, int from);

  // The ordered mode (transport_ordered.cpp; see the top of this file).
  struct Channel {
    int64_t expected = 0;  // messages this step
    int64_t taken = 0;     // messages read
    std::optional<Pending> header;   // the next message's header, posted
    std::vector<Pending> predicted;  // and its predicted tensors
    bool has_prediction = false;
    std::optional<std::pair<int64_t, std::string>> failure;  // what the peer announced
  };
  /// The group a hand-off from rank `from` to rank `to` travels on.
  c10d::ProcessGroup& lane_group(int from, int to) const;
  void ordered_begin(const Handoffs& handoffs);
  /// Ordered mode, before the first step: a message each way between every
  /// pair of ranks that will talk, in one order all ranks share.
  void connect();
  /// Buries every receive the channels posted; empties them and the inbox.
  void drop_channels();
  void ordered_send(const Address& to, int dst, Batch batch);
  std::optional<Payload> ordered_receive(const Address& at, int from);
  /// Posts message `channel.taken` of `from`'s channel: its header and
  /// predicted tensors (under mutex_).
  void post_next(int from, Channel& channel);
  /// Reads the next message of `from`'s channel into `inbox_`; false when
  /// cancelled.
  bool read_next(int from, Channel& channel, const std::string& what);
  /// Sends `t` (moved to where the backend reads it) to `dst`; kept in sent_works_.
  void send_tensor(at::Tensor t, int dst, int tag, std::vector<Pending>& out);
  /// `t` where the backend reads it: on the host over Gloo, else on device_;
  /// contiguous.
  at::Tensor on_wire(at::Tensor t) const;
  /// `batch`'s defined values on_wire: a hand-off makes them before its
  /// header goes, so a value that cannot travel fails the send while the
  /// peer still waits for a header (where a failure header reaches it).
  Batch wire_values(Batch batch) const;
  at::Tensor wire_tensor(int64_t ints) const;
  /// A received value on device_ (copied there from the host over Gloo).
  at::Tensor landed(at::Tensor t) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::ProcessGroup> reverse_;
  int rank_;
  int size_;
  int64_t stages_;
  std::vector<int64_t> placement_;  // stage -> rank; empty: s mod size_
  c10::Device device_;
  bool gloo_;
  // The group's own timeout (zero where its backend does not say).
  std::chrono::milliseconds group_timeout_{0};
  // Whether Work::abort ends one op's wait only (Gloo); see the top of this file.
  bool abortable_ = false;
  bool ordered_ = false;
  bool connected_ = false;
  // Where this rank waits for receives on an accelerator (ordered mode).
  std::optional<c10::Stream> side_;
  HeldStreams side_held_;
  int64_t microbatches_ = 0;
  std::vector<SkipRoute> routes_;
  std::optional<Mailboxes> local_;

  std::mutex mutex_;
  std::map<Key, Pending> headers_;   // posted header receives not yet taken
  std::vector<Pending> waiting_;     // receives being waited on (cancel aborts them on Gloo)
  std::deque<Pending> sent_works_;   // sends not yet known to be taken, in order
  std::atomic<int64_t> step_timeout_ms_{0};  // 0: the group's timeout
  // The reaper (Gloo; see the top of this file): the send it waits for, how
  // a send failed (it then stops there, and finish reports it), its stop.
  std::condition_variable sends_changed_;  // a send queued, taken or failed; a stop
  c10::intrusive_ptr<c10d::Work> reaping_;
  std::exception_ptr send_error_;
  bool stop_reaper_ = false;
  std::set<Key> owed_;               // addresses this step sends to, not yet sent
  // Last step's metadata per address, as sent and as received (the same
  // when both ends ran it): the shapes of the early receives.
  std::map<Key, BatchMeta> sent_meta_;
  std::map<Key, BatchMeta> received_meta_;
  std::map<Key, std::vector<Pending>> early_;  // tensors' receives posted early
  std::vector<Address> upcoming_;              // this step's remote receives, in order
  size_t taken_ = 0;                           // how many of them were received
  // Ordered mode: the channels by sending rank, messages read before they
  // were asked for, messages sent per rank this step, and last step's
  // metadata per (peer, message) as sent and as received.
  std::map<int, Channel> channels_;
  std::map<Key, Payload> inbox_;
  std::map<int, int64_t> sent_count_;
  std::map<std::pair<int, int64_t>, BatchMeta> sent_order_meta_;
  std::map<std::pair<int, int64_t>, BatchMeta> received_order_meta_;
  std::atomic<bool> cancelled_{false};
  // The sender (see the top of this file): hand-offs queued by the workers,
  // whether it is delivering one, how a delivery failed, its stop.
  struct Outgoing {
    Address to;
    int dst;
    Payload payload;
  };
  std::mutex sender_mutex_;
  std::condition_variable outgoing_changed_;
  std::deque<Outgoing> outgoing_;
  bool delivering_ = false;
  bool stop_sender_ = false;
  std::exception_ptr sender_error_;
  // The failure a peer announced: its rank and message.
  std::optional<std::pair<int64_t, std::string>> peer_failure_;
  // Last: started when everything they read exists, joined (stop_sender,
  // stop_reaper) before anything is destroyed.
  std::thread reaper_;
  std::thread sender_;
};

}  // namespace gpipe::detail
