// transport_c10d.cpp — the process-group transport's shared mechanics: construction, sends and waits, the reaper, finish and failure; each mode's matching in transport_tagged.cpp and transport_ordered.cpp.
#include "transport_c10d.h"

#include "check.h"
#include "transport_wire.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/pin_memory.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <limits>
#include <thread>

namespace gpipe::detail {

namespace wire {

std::vector<int64_t> pack(int64_t origin, const std::string& text) {
  const std::string cut = text.substr(0, std::min(text.size(), kFailureChars));
  std::vector<int64_t> ints{origin};
  std::vector<int64_t> chars((cut.size() + sizeof(int64_t) - 1) / sizeof(int64_t), 0);
  for (size_t k = 0; k < cut.size(); ++k) {
    chars[k / 8] |= static_cast<int64_t>(static_cast<uint8_t>(cut[k])) << (8 * (k % 8));
  }
  ints.insert(ints.end(), chars.begin(), chars.end());
  return ints;
}

std::pair<int64_t, std::string> unpack(const std::vector<int64_t>& ints) {
  TORCH_CHECK(!ints.empty(), "gpipe: empty failure header");
  std::string text;
  for (size_t k = 1; k < ints.size(); ++k) {
    for (size_t b = 0; b < sizeof(int64_t); ++b) {
      const auto c = static_cast<char>((static_cast<uint64_t>(ints[k]) >> (8 * b)) & 0xff);
      if (c == '\0') return {ints[0], text};
      text.push_back(c);
    }
  }
  return {ints[0], text};
}

const char* flow_name(Flow flow) {
  switch (flow) {
    case Flow::Activation:
      return "activations";
    case Flow::Grad:
      return "grads";
    case Flow::Skip:
      return "skip";
    case Flow::SkipGrad:
      return "skip grad";
  }
  return "?";
}

std::pair<at::Tensor, at::Tensor> wire_parts(const std::vector<int64_t>& ints, int64_t kind) {
  const auto length = static_cast<int64_t>(ints.size());
  at::Tensor head = at::zeros({kWireInts}, at::kLong);
  auto* w = head.data_ptr<int64_t>();
  w[0] = kind;
  w[1] = length;
  std::copy_n(ints.begin(), std::min(length, kWireBody), w + 2);
  at::Tensor rest;
  if (length > kWireBody) {
    rest = at::empty({length - kWireBody}, at::kLong);
    std::copy(ints.begin() + kWireBody, ints.end(), rest.data_ptr<int64_t>());
  }
  return {head, rest};
}

}  // namespace wire

using namespace wire;

Handoffs plan_handoffs(const Plan& plan, int64_t worker, const std::vector<SkipRoute>& routes) {
  Handoffs h;
  const int64_t last = plan.stages - 1;
  for (const auto& t : plan.lists[static_cast<size_t>(worker)]) {
    const int64_t s = t.stage;
    const int64_t i = t.microbatch;
    if (t.op == Op::F) {
      if (s > 0) h.receives.push_back({s, Flow::Activation, i});
      if (s < last) h.sends.push_back({s + 1, Flow::Activation, i});
    } else if (t.op == Op::B || t.op == Op::I) {
      if (s < last) h.receives.push_back({s, Flow::Grad, i});
      if (s > 0) h.sends.push_back({s - 1, Flow::Grad, i});
    } else {
      continue;
    }
    // Skips travel with the forward (stashed at `from`, popped at `to`),
    // their grads with the backward (I, when split), straight back.
    for (size_t r = 0; r < routes.size(); ++r) {
      const auto route = static_cast<int64_t>(r);
      const auto& [from, to] = routes[r];
      if (t.op == Op::F) {
        if (to == s) h.receives.push_back({s, Flow::Skip, i, route});
        if (from == s) h.sends.push_back({to, Flow::Skip, i, route});
      } else {
        if (from == s) h.receives.push_back({s, Flow::SkipGrad, i, route});
        if (to == s) h.sends.push_back({from, Flow::SkipGrad, i, route});
      }
    }
  }
  return h;
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                             c10::intrusive_ptr<c10d::ProcessGroup> reverse,
                                             int64_t stages, c10::Device device,
                                             std::vector<int64_t> placement)
    : group_(std::move(group)),
      reverse_(std::move(reverse)),
      rank_(0),
      size_(1),
      stages_(stages),
      placement_(std::move(placement)),
      device_(device) {
  TORCH_CHECK(group_, "gpipe: no process group; call torch.distributed.init_process_group() "
                      "(or pass group=) before building the pipe");
  if (!reverse_) reverse_ = group_;
  GPIPE_CHECK_VALUE(reverse_->getSize() == group_->getSize() &&
                        reverse_->getRank() == group_->getRank(),
                    "the reverse group has ", reverse_->getSize(), " ranks (this one ",
                    reverse_->getRank(), ") but the pipeline group ", group_->getSize(),
                    " (this one ", group_->getRank(), "); make it over the same ranks in the "
                    "same order");
  rank_ = group_->getRank();
  size_ = group_->getSize();
  TORCH_CHECK(stages_ >= size_ && stages_ % size_ == 0, "gpipe: ", stages_,
              " stages over a group of ", size_, " ranks; give each rank the same number of "
              "stages (a multiple of ", size_, ")");
  if (!placement_.empty()) {
    std::vector<int64_t> held(static_cast<size_t>(size_), 0);
    for (const int64_t r : placement_) {
      TORCH_INTERNAL_ASSERT(r >= 0 && r < size_, "placement names rank ", r, " of ", size_);
      ++held[static_cast<size_t>(r)];
    }
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(placement_.size()) == stages_ &&
                              std::all_of(held.begin(), held.end(),
                                          [&](int64_t n) { return n == stages_ / size_; }),
                          "placement of ", placement_.size(), " stages is not ", stages_ / size_,
                          " per rank");
  }
  const std::string backend = group_->getBackendName();
  gloo_ = backend == "gloo";
  abortable_ = gloo_;
  ordered_ = !gloo_;
  try {
    group_timeout_ = group_->getDefaultBackend()->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    // A backend that keeps no options: polls are bounded by step_timeout only.
  }
  if (const char* env = std::getenv("GPIPE_HANDOFFS"); env != nullptr && *env != '\0') {
    const std::string mode = env;
    GPIPE_CHECK_VALUE(mode == "ordered" || mode == "tagged", "GPIPE_HANDOFFS is '", mode,
                      "'; set it to 'ordered' or 'tagged', or unset it (the backend's default)");
    ordered_ = mode == "ordered";
  }
  if (size_ > 1 && backend == "nccl") {
    GPIPE_CHECK_VALUE(ordered_, "GPIPE_HANDOFFS=tagged, but NCCL matches messages by order, not "
                      "by tag; unset GPIPE_HANDOFFS");
    GPIPE_CHECK_VALUE(reverse_ != group_, "over NCCL the pipe needs a second group over the same "
                      "ranks for hand-offs to lower ranks (NCCL runs a pair's sends and receives "
                      "on one in-order queue, so hand-offs both ways on one group could wait on "
                      "each other); pass reverse_group (gpipe.distributed.Pipe makes it itself)");
    GPIPE_CHECK_VALUE(!device_.is_cpu(), "over NCCL the stages must run on this rank's GPU, but "
                      "the device is ", device_, "; pass device=torch.device('cuda', local_rank), "
                      "or give the pipe a Gloo group");
  }
  if (ordered_ && !device_.is_cpu()) {
    // Never a lane's stream (take_pool_stream): an early receive waits
    // here for its peer, and would hold back compute queued behind it.
    side_ = take_pool_stream(device_);
    side_held_ = hold({*side_});
  }
  // Checked before any thread starts (a constructor that throws with a
  // thread running would terminate).
  const char* async = std::getenv("GPIPE_ASYNC_SENDS");
  if (async != nullptr && *async != '\0') {
    const std::string mode = async;
    GPIPE_CHECK_VALUE(mode == "0" || mode == "1", "GPIPE_ASYNC_SENDS is '", mode,
                      "'; set it to 1 (sends on a thread of their own, the default) or 0 (on "
                      "the worker), or unset it");
  }
  // Gloo's sends say they are done only to a wait (see reap_in_order).
  if (gloo_ && size_ > 1) reaper_ = std::thread([this] { reap_in_order(); });
  if (size_ > 1 && (async == nullptr || std::string(async) != "0")) {
    sender_ = std::thread([this] { send_in_order(); });
  }
}

ProcessGroupTransport::~ProcessGroupTransport() {
  stop_sender();
  stop_reaper();
  // A step that ended normally left nothing in flight; after a failure
  // `fail` buried what was. Anything left here comes from an exception
  // between begin and finish/fail: drop it the same careful way.
  std::lock_guard<std::mutex> hold(mutex_);
  for (auto& [k, p] : headers_) drop(std::move(p));
  for (auto& p : sent_works_) bury(std::move(p));
  drop_channels();
  for (auto& [k, ps] : early_) {
    for (auto& p : ps) drop(std::move(p));
  }
}

std::vector<int64_t> ProcessGroupTransport::stages_of(int rank) const {
  std::vector<int64_t> stages;
  for (int64_t s = 0; s < stages_; ++s) {
    if (owner(s) == rank) stages.push_back(s);
  }
  return stages;
}

int ProcessGroupTransport::source(const Address& at) const {
  switch (at.flow) {
    case Flow::Activation:
      return owner(at.stage - 1);
    case Flow::Grad:
      return owner(at.stage + 1);
    case Flow::Skip:
    case Flow::SkipGrad:
      TORCH_INTERNAL_ASSERT(at.route >= 0 && at.route < static_cast<int64_t>(routes_.size()));
      const auto& route = routes_[static_cast<size_t>(at.route)];
      return owner(at.flow == Flow::Skip ? route.from : route.to);
  }
  return rank_;
}

int ProcessGroupTransport::tag(const Address& a, int part) const {
  // One row per (stage, activations or grads), then per (route, skip or
  // its grad), as the mailboxes lay them out; rows per micro-batch.
  const auto rows = (stages_ + static_cast<int64_t>(routes_.size())) * 2;
  const int64_t row = a.flow == Flow::Activation || a.flow == Flow::Grad
                          ? a.stage * 2 + static_cast<int64_t>(a.flow)
                          : (stages_ + a.route) * 2 + (a.flow == Flow::Skip ? 0 : 1);
  const int64_t t = (a.microbatch * rows + row) * 3 + part;
  TORCH_CHECK(t <= std::numeric_limits<int>::max(), "gpipe: ", stages_, " stages and ",
              microbatches_, " micro-batches exceed the tags of a process group; use fewer "
              "chunks");
  return static_cast<int>(t);
}

std::string ProcessGroupTransport::describe_address(const Address& a) const {
  // The action that waits for it, also in torch.distributed.pipelining's
  // notation: F for a forward; B for a backward (I under zb_h1).
  const bool forward = a.flow == Flow::Activation || a.flow == Flow::Skip;
  const std::string action =
      c10::str(forward ? "forward" : "backward", " ", a.stage, forward ? "F" : "B", a.microbatch);
  if (a.flow == Flow::Skip || a.flow == Flow::SkipGrad) {
    return c10::str("stage ", a.stage, "'s ", flow_name(a.flow), " of route ", a.route,
                    " for micro-batch ", a.microbatch, ", for its ", action);
  }
  return c10::str("stage ", a.stage, "'s ", flow_name(a.flow), " of micro-batch ", a.microbatch,
                  ", for its ", action);
}

void ProcessGroupTransport::peer_failed(const std::pair<int64_t, std::string>& failure, int from,
                                        const std::string& what) const {
  const auto& [origin, text] = failure;
  fail_between_ranks("gpipe: rank ", origin, " failed, so rank ", rank_, " stopped waiting for ",
                     what, " (from rank ", from, "); rank ", origin, "'s error: ", text);
}

void ProcessGroupTransport::bury(Pending pending) {
  // An aborted Gloo receive may still be matched by a late message, which
  // then writes into its buffer: the buffer (and its work) must outlive
  // that. After a failed step that is the process's lifetime; the pipe
  // refuses further steps, so this holds one step's worth at most.
  static auto* graveyard = new std::vector<Pending>();
  static std::mutex lock;
  std::lock_guard<std::mutex> hold(lock);
  graveyard->push_back(std::move(pending));
}

void ProcessGroupTransport::drop(Pending pending) const {
  // Gloo: the abort ends the op's wait and takes it off the pair's queue.
  // Anywhere else it may take the communicator down with it (see the top
  // of transport_c10d.h): the op stays posted, its buffer buried.
  if (abortable_ && pending.work) pending.work->abort();
  bury(std::move(pending));
}

std::chrono::milliseconds ProcessGroupTransport::poll_limit() const {
  const auto limit = step_timeout();
  return limit.count() > 0 ? limit : group_timeout_;
}

const char* ProcessGroupTransport::limit_name() const {
  return step_timeout().count() > 0 ? "the pipe's step_timeout" : "the process group's timeout";
}

ProcessGroupTransport::Polled ProcessGroupTransport::poll(c10d::Work& work,
                                                         bool cancellable) const {
  const auto limit = poll_limit();
  const auto started = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(1);
  while (!work.isCompleted()) {
    if (cancellable && cancelled_.load()) return Polled::Cancelled;
    if (limit.count() > 0 && std::chrono::steady_clock::now() - started >= limit) {
      return Polled::OutOfTime;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(200));
  }
  return Polled::Done;
}

void ProcessGroupTransport::keep_sent(std::vector<Pending>& out) {
  reap();
  for (auto& p : out) sent_works_.push_back(std::move(p));
  sends_changed_.notify_all();
}

void ProcessGroupTransport::reap() {
  // A send's tensors are released as soon as its send is known to be done
  // (see the top of transport_c10d.h): a stage that runs 1F1B keeps K
  // micro-batches alive, not the M a step sends. Only a send that completed
  // successfully goes: one still in flight must outlive its transfer (the
  // backend reads the tensor's memory until then; see bury), and a failed
  // one stays for finish() to report. On NCCL, isCompleted() means the GPU
  // is done with the send, and dropping our reference would be safe even
  // earlier: ProcessGroupNCCL's point-to-point ops keep the caching
  // allocator from reusing a sent tensor's memory until the communication
  // stream has passed the send (they record the tensor on that stream, or
  // with TORCH_NCCL_AVOID_RECORD_STREAMS stash it on the work).
  //
  // Gloo's works say isCompleted() only after a wait: there the reaper
  // thread waits for them instead, and this poll would find nothing.
  if (reaper_.joinable()) return;
  std::erase_if(sent_works_, [](const Pending& p) {
    return p.work->isCompleted() && !p.work->exception();
  });
}

void ProcessGroupTransport::reap_in_order() {
  // Gloo: a send is done once the peer posted its receive and the bytes
  // left (the receives are posted early, see the top of transport_c10d.h,
  // so this is soon after the send), but its work says so only to a wait,
  // and a wait cannot poll: one that times out fails every pending op of
  // the group. So this thread waits for each send in the order they were
  // queued, and drops the send (its tensors) when its wait returns. A wait
  // lasts until the peer asks, as a receive's does, within the group's
  // timeout. On an error the reaper stops at that send: finish() reports
  // it, fail() buries it and the rest.
  std::unique_lock<std::mutex> hold(mutex_);
  while (true) {
    sends_changed_.wait(hold, [&] {
      return stop_reaper_ || (!sent_works_.empty() && !send_error_);
    });
    if (stop_reaper_) return;
    c10::intrusive_ptr<c10d::Work> work = sent_works_.front().work;
    reaping_ = work;
    hold.unlock();
    bool taken = false;
    std::exception_ptr error;
    try {
      taken = work->wait();
    } catch (...) {
      error = std::current_exception();
    }
    hold.lock();
    reaping_.reset();
    // Meanwhile fail() (or finish()) may have taken the queue: only a send
    // still at its front is this thread's to drop.
    if (sent_works_.empty() || sent_works_.front().work != work) continue;
    if (error) {
      send_error_ = error;
      sends_changed_.notify_all();
      continue;
    }
    if (!taken) {
      // The wait was aborted, which only stop_reaper does; the send may
      // still be in flight and stays queued (the destructor buries it).
      // Anyone else's abort is a failure, not a reason to spin on the send.
      if (!stop_reaper_) {
        send_error_ = std::make_exception_ptr(
            c10::Error("the wait for a send was aborted", /*backtrace=*/nullptr));
        sends_changed_.notify_all();
      }
      continue;
    }
    // Taken: its tensors go now (before finish() can see the queue empty).
    sent_works_.pop_front();
    sends_changed_.notify_all();
  }
}

void ProcessGroupTransport::stop_reaper() {
  if (!reaper_.joinable()) return;
  {
    std::lock_guard<std::mutex> hold(mutex_);
    stop_reaper_ = true;
    // Ends the wait only: Gloo's SendWork::abort wakes its waiter and
    // leaves the send in flight (it stays in sent_works_, to be buried).
    if (reaping_) reaping_->abort();
  }
  sends_changed_.notify_all();
  reaper_.join();
}

void ProcessGroupTransport::begin(int64_t microbatches, const Handoffs& handoffs,
                                  std::vector<SkipRoute> routes) {
  microbatches_ = microbatches;
  routes_ = std::move(routes);
  cancelled_.store(false);
  peer_failure_.reset();
  local_.emplace(stages_, microbatches, static_cast<int64_t>(routes_.size()));
  {
    std::lock_guard<std::mutex> hold(sender_mutex_);
    TORCH_INTERNAL_ASSERT(outgoing_.empty() && !delivering_ && !sender_error_);
  }
  if (ordered_ && !connected_ && size_ > 1) {
    connect();
    connected_ = true;
  }
  std::lock_guard<std::mutex> hold(mutex_);
  TORCH_INTERNAL_ASSERT(headers_.empty() && sent_works_.empty() && !send_error_);
  owed_.clear();
  for (const auto& a : handoffs.sends) {
    if (owner(a.stage) != rank_) owed_.insert(key(a));
  }
  if (ordered_) {
    ordered_begin(handoffs);
  } else {
    tagged_begin(handoffs);
  }
}

ProcessGroupTransport::Pending ProcessGroupTransport::post_receive(c10d::ProcessGroup& group,
                                                                   std::vector<at::Tensor> tensors,
                                                                   int from, int tag) {
  Pending p;
  p.tensors = std::move(tensors);
  p.work = group.recv(p.tensors, from, tag);
  return p;
}

std::vector<ProcessGroupTransport::Pending> ProcessGroupTransport::post_values(
    c10d::ProcessGroup& group, const BatchMeta& meta, int from, int tag) {
  std::vector<Pending> posted;
  for (const auto& v : meta.values) {
    if (!v.defined) continue;
    posted.push_back(post_receive(
        group, {at::empty(v.shape, at::TensorOptions().dtype(v.dtype).device(wire_device()))},
        from, tag));
  }
  return posted;
}

bool ProcessGroupTransport::wait(Pending& pending, int from, const std::string& what,
                                 bool on_host) {
  {
    std::lock_guard<std::mutex> hold(mutex_);
    if (cancelled_.load()) {
      drop(std::move(pending));
      return false;
    }
    waiting_.push_back(pending);
  }
  bool done = false;
  bool out_of_time = false;
  std::exception_ptr error;
  const auto limit = abortable_ ? step_timeout() : poll_limit();
  const auto started = std::chrono::steady_clock::now();
  try {
    // Gloo: wait() blocks until the op is done (a cancel aborts it; a
    // timeout that runs out throws, and fails the group's other pending
    // ops: the step fails anyway). Elsewhere (NCCL) wait() does not block
    // the host, it only orders the current stream after the op: where the
    // host reads the result, poll until it is done (a cancel ends the
    // poll), then wait() orders the stream and reports a failed op.
    if (abortable_) {
      done = limit.count() > 0 ? pending.work->wait(limit) : pending.work->wait();
    } else if (!on_host && !device_.is_cpu()) {
      done = pending.work->wait();
    } else {
      switch (poll(*pending.work, /*cancellable=*/true)) {
        case Polled::Done:
          // A failed op also completes (NCCL: after its communicator was
          // aborted); its wait() might not say so.
          if (auto failed = pending.work->exception()) std::rethrow_exception(failed);
          done = pending.work->wait();
          break;
        case Polled::Cancelled:
          break;
        case Polled::OutOfTime:
          out_of_time = true;
          throw c10::Error("still not received", /*backtrace=*/nullptr);
      }
    }
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> hold(mutex_);
    waiting_.erase(std::find_if(waiting_.begin(), waiting_.end(),
                                [&](const Pending& p) { return p.work == pending.work; }));
  }
  if (error) {
    std::string message;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "unknown error";
    }
    // Gloo's wait says only that it timed out: so did the step when the
    // step_timeout has passed.
    if (out_of_time || (abortable_ && limit.count() > 0 &&
                        std::chrono::steady_clock::now() - started >= limit)) {
      fail_between_ranks("gpipe: rank ", rank_, " waited ", limit.count() / 1000.0, " s (",
                         limit_name(), ") for ", what, ", from rank ", from,
                         "; rank ", from, " is stuck (a layer that does not return, a step it "
                         "did not start) or dead (", message, ")");
    }
    fail_between_ranks("gpipe: rank ", rank_, " lost rank ", from, " while receiving ", what,
                ": ", message, " (rank ", from, " died, or did not answer within the process "
                "group's timeout)");
  }
  if (!done || cancelled_.load()) {
    bury(std::move(pending));
    return false;
  }
  return true;
}

c10::Device ProcessGroupTransport::wire_device() const {
  // NCCL moves device memory only. Gloo's point-to-point reads and writes
  // host memory only (it takes the data pointer as it is: a CUDA tensor's
  // would be written by the CPU), so over Gloo a stage on a GPU sends and
  // receives through the host.
  return gloo_ ? c10::Device(c10::kCPU) : device_;
}

at::Tensor ProcessGroupTransport::landed(at::Tensor t) const {
  // A plain (blocking) copy: the host's buffer is free once it returns.
  return t.device() == device_ ? t : t.to(device_);
}

at::Tensor ProcessGroupTransport::wire_tensor(int64_t ints) const {
  return at::empty({ints}, at::TensorOptions().dtype(at::kLong).device(wire_device()));
}

void ProcessGroupTransport::send_tensor(at::Tensor t, int dst, int tag, std::vector<Pending>& out) {
  Pending p;
  p.tensors = {on_wire(std::move(t))};
  p.work = (ordered_ ? lane_group(rank_, dst) : *group_).send(p.tensors, dst, tag);
  out.push_back(std::move(p));
}

Batch ProcessGroupTransport::wire_values(Batch batch) const {
  for (auto& value : batch.values) {
    if (value.defined()) value = on_wire(value.detach());
  }
  return batch;
}

at::Tensor ProcessGroupTransport::on_wire(at::Tensor t) const {
  if (gloo_) {
    // Gloo reads the tensor's memory on the host.
    if (!t.device().is_cpu()) t = t.cpu();
  } else if (t.device().is_cpu() && !device_.is_cpu()) {
    // Built on the host (a header, its rest): staged through pinned memory
    // and copied without blocking, on the current stream, which the
    // backend orders the send after. A pageable .to(device) would wait for
    // that stream, and so for the stage's queued compute, before the worker
    // could go on. The caching host allocator keeps the pinned block until
    // the copy has run, whenever the staging tensor is freed.
    t = t.pin_memory().to(device_, /*non_blocking=*/true);
  } else if (t.device() != device_) {
    t = t.to(device_);
  }
  return t.contiguous();
}

void ProcessGroupTransport::send_values(const Batch& batch, int dst, int tag,
                                        std::vector<Pending>& out) {
  for (const auto& value : batch.values) {
    if (value.defined()) send_tensor(value.detach(), dst, tag, out);
  }
}

void ProcessGroupTransport::send_filler(const BatchMeta& expected, int dst, int tag,
                                        std::vector<Pending>& out) {
  for (const auto& v : expected.values) {
    if (v.defined) {
      send_tensor(at::empty(v.shape, at::TensorOptions().dtype(v.dtype).device(wire_device())),
                  dst, tag, out);
    }
  }
}

void ProcessGroupTransport::send_wire(const std::vector<int64_t>& ints, int64_t kind, int to,
                                      int tag) {
  auto [head, rest] = wire_parts(ints, kind);
  std::vector<Pending> out;
  send_tensor(head, to, tag, out);
  if (rest.defined()) send_tensor(rest, to, tag, out);
  std::lock_guard<std::mutex> hold(mutex_);
  keep_sent(out);
}

void ProcessGroupTransport::send(const Address& to, Payload payload) {
  const int dst = owner(to.stage);
  if (dst == rank_) {
    local_->send(to, std::move(payload));
    return;
  }
  if (sender_.joinable()) {
    std::lock_guard<std::mutex> hold(sender_mutex_);
    outgoing_.push_back(Outgoing{to, dst, std::move(payload)});
    outgoing_changed_.notify_all();
    return;
  }
  deliver(to, dst, std::move(payload));
}

void ProcessGroupTransport::deliver(const Address& to, int dst, Payload payload) {
  Batch batch = settle(std::move(payload));
  if (ordered_) {
    ordered_send(to, dst, std::move(batch));
  } else {
    tagged_send(to, dst, std::move(batch));
  }
}

std::optional<Payload> ProcessGroupTransport::receive(const Address& at) {
  const int from = source(at);
  if (from == rank_) return local_->receive(at);
  return ordered_ ? ordered_receive(at, from) : tagged_receive(at, from);
}

void ProcessGroupTransport::cancel() {
  std::lock_guard<std::mutex> hold(mutex_);
  cancelled_.store(true);
  // Gloo: the abort wakes the wait. Elsewhere the waits poll cancelled_.
  if (abortable_) {
    for (auto& p : waiting_) p.work->abort();
  }
  if (local_) local_->cancel();
}

void ProcessGroupTransport::send_in_order() {
  // On a GPU the sender's current stream (the device's default) waits for
  // each payload's ready events (settle) before the backend reads it.
  std::optional<c10::DeviceGuard> on_device;
  if (!device_.is_cpu()) on_device.emplace(device_);
  std::unique_lock<std::mutex> hold(sender_mutex_);
  while (true) {
    outgoing_changed_.wait(hold, [&] {
      return stop_sender_ || (!outgoing_.empty() && !sender_error_);
    });
    if (stop_sender_) return;
    Outgoing next = std::move(outgoing_.front());
    outgoing_.pop_front();
    delivering_ = true;
    hold.unlock();
    std::exception_ptr error;
    try {
      deliver(next.to, next.dst, std::move(next.payload));
    } catch (...) {
      error = std::current_exception();
    }
    hold.lock();
    delivering_ = false;
    if (error) sender_error_ = error;
    outgoing_changed_.notify_all();
    if (error) {
      // The workers may wait for a peer that waits for this hand-off: stop
      // them now (finish() reports the error, fail() tells the peers).
      hold.unlock();
      cancel();
      hold.lock();
    }
  }
}

void ProcessGroupTransport::drain_sends() {
  if (!sender_.joinable()) return;
  std::unique_lock<std::mutex> hold(sender_mutex_);
  outgoing_changed_.wait(hold, [&] {
    return (outgoing_.empty() && !delivering_) || sender_error_;
  });
  if (!sender_error_) return;
  const std::exception_ptr error = sender_error_;
  hold.unlock();
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    fail_between_ranks("gpipe: rank ", rank_, " could not hand its outputs on: ", e.what());
  }
}

void ProcessGroupTransport::drop_sends() {
  if (!sender_.joinable()) return;
  std::unique_lock<std::mutex> hold(sender_mutex_);
  outgoing_.clear();  // never sent: their addresses stay owed (failure headers)
  outgoing_changed_.wait(hold, [&] { return !delivering_; });
  sender_error_ = nullptr;
}

void ProcessGroupTransport::stop_sender() {
  if (!sender_.joinable()) return;
  {
    std::lock_guard<std::mutex> hold(sender_mutex_);
    stop_sender_ = true;
  }
  outgoing_changed_.notify_all();
  sender_.join();
}

void ProcessGroupTransport::finish() {
  // Everything the workers sent is posted first (or its failure reported).
  drain_sends();
  {
    std::lock_guard<std::mutex> hold(mutex_);
    TORCH_INTERNAL_ASSERT(headers_.empty() && early_.empty(), "gpipe: a step ended with ",
                          headers_.size(), " hand-offs not received");
    TORCH_INTERNAL_ASSERT(inbox_.empty(), "gpipe: a step ended with ", inbox_.size(),
                          " hand-offs received but not taken");
    for (const auto& [from, channel] : channels_) {
      TORCH_INTERNAL_ASSERT(channel.taken == channel.expected, "gpipe: a step ended with ",
                            channel.expected - channel.taken, " hand-offs from rank ", from,
                            " not received");
    }
  }
  // What is left: sends not known to be taken yet. With a reaper, it is
  // waiting through them; without, wait here, in order. Either way a send
  // stays queued until it is done, so a failure leaves the rest (maybe in
  // flight) for fail() to bury.
  std::unique_lock<std::mutex> hold(mutex_);
  const auto limit = step_timeout();
  const auto taken = [&] { return sent_works_.empty() || send_error_; };
  const auto not_taken = [&](std::chrono::milliseconds waited) {
    fail_between_ranks("gpipe: rank ", rank_, " waited ", waited.count() / 1000.0, " s (",
                       limit_name(), ") for the ranks it sent to to take its last hand-offs; "
                       "one of them is stuck or dead");
  };
  if (reaper_.joinable()) {
    if (limit.count() == 0) {
      sends_changed_.wait(hold, taken);
    } else if (!sends_changed_.wait_for(hold, limit, taken)) {
      hold.unlock();
      not_taken(limit);
    }
  }
  while (!send_error_ && !sent_works_.empty()) {
    c10::intrusive_ptr<c10d::Work> work = sent_works_.front().work;
    hold.unlock();
    // NCCL's wait would not block: poll until the GPU is past the send.
    if (!abortable_ && poll(*work, /*cancellable=*/false) == Polled::OutOfTime) {
      not_taken(poll_limit());
    }
    try {
      // (Polled: returns at once, throwing if the send failed.)
      if (auto failed = work->exception()) std::rethrow_exception(failed);
      if (abortable_ && limit.count() > 0) {
        work->wait(limit);
      } else {
        work->wait();
      }
    } catch (...) {
      hold.lock();
      send_error_ = std::current_exception();
      break;
    }
    hold.lock();
    if (!sent_works_.empty() && sent_works_.front().work == work) sent_works_.pop_front();
  }
  if (send_error_) {
    try {
      std::rethrow_exception(send_error_);
    } catch (const std::exception& e) {
      fail_between_ranks("gpipe: rank ", rank_, " could not hand its outputs on: ", e.what());
    }
  }
}

void ProcessGroupTransport::fail(const std::string& what) {
  // Queued hand-offs are not sent: their addresses get failure headers.
  drop_sends();
  const auto [origin, text] =
      peer_failure_ ? *peer_failure_ : std::pair<int64_t, std::string>{rank_, first_line(what)};
  std::set<Key> owed;
  {
    std::lock_guard<std::mutex> hold(mutex_);
    owed.swap(owed_);
  }
  // Peers that died refuse the message: nothing to tell them.
  if (ordered_) {
    // Once per rank still owed a message: where its next header is due.
    std::set<int> ranks;
    for (const auto& [stage, flow, microbatch, route] : owed) ranks.insert(owner(stage));
    for (int dst : ranks) {
      try {
        send_wire(pack(origin, text), kFailure, dst, 0);
      } catch (const std::exception&) {
      }
    }
    owed.clear();
  }
  for (const auto& [stage, flow, microbatch, route] : owed) {
    const Address a{stage, static_cast<Flow>(flow), microbatch, route};
    try {
      send_wire(pack(origin, text), kFailure, owner(stage), tag(a, 0));
    } catch (const std::exception&) {
    }
  }
  std::lock_guard<std::mutex> hold(mutex_);
  for (auto& [k, p] : headers_) drop(std::move(p));
  headers_.clear();
  for (auto& [k, ps] : early_) {
    for (auto& p : ps) drop(std::move(p));
  }
  early_.clear();
  drop_channels();
  // Sends nobody will take: kept alive (they may still be read). The
  // reaper may be waiting for one of them; it holds a reference of its own
  // and drops nothing it no longer finds queued.
  for (auto& p : sent_works_) bury(std::move(p));
  sent_works_.clear();
  send_error_ = nullptr;
}


}  // namespace gpipe::detail
