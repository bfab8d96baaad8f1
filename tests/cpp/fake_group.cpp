// fake_group.cpp — the fake process groups: one shared world per make_fake_groups call, matching by tag or by per-peer order.
#include "fake_group.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

namespace gpipe_test {

namespace {

class World;

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes() << " " << t.scalar_type();
  return s.str();
}

// A failure between fake ranks: the message says it all, a backtrace of the
// test's thread would only hide it.
template <typename... Args>
std::exception_ptr error(const Args&... args) {
  return std::make_exception_ptr(c10::Error(c10::str(args...), /*backtrace=*/nullptr));
}

// One op's completion. The world completes it under its own lock; wait()
// needs only the work's, so a work outlives its world safely (the
// transport keeps aborted works for the process's life).
class FakeWork : public c10d::Work {
 public:
  FakeWork(int rank, c10d::OpType type, std::string what, std::weak_ptr<World> world,
           std::chrono::milliseconds timeout, bool like_nccl)
      : c10d::Work(rank, type),
        what_(std::move(what)),
        world_(std::move(world)),
        timeout_(timeout),
        like_nccl_(like_nccl) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> hold(lock_);
    return state_ != State::Pending;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> hold(lock_);
    return state_ == State::Done;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> hold(lock_);
    return error_;
  }
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override;

  // By the world, under its lock: the op ran (with `failure`: failed).
  void complete(std::exception_ptr failure = nullptr) {
    {
      std::lock_guard<std::mutex> hold(lock_);
      if (state_ != State::Pending) return;
      state_ = failure ? State::Failed : State::Done;
      error_ = std::move(failure);
    }
    done_.notify_all();
  }
  // By the world, under its lock: the op was taken off its queue unrun.
  void aborted() {
    {
      std::lock_guard<std::mutex> hold(lock_);
      if (state_ != State::Pending) return;
      state_ = State::Aborted;
    }
    done_.notify_all();
  }
  const std::string& what() const noexcept { return what_; }

 private:
  enum class State { Pending, Done, Failed, Aborted };
  mutable std::mutex lock_;
  std::condition_variable done_;
  State state_ = State::Pending;
  std::exception_ptr error_;
  const std::string what_;
  const std::weak_ptr<World> world_;
  const std::chrono::milliseconds timeout_;
  const bool like_nccl_;
};

// A send (its data: a copy under ByTag) or a recv (its buffer).
struct Op {
  c10::intrusive_ptr<FakeWork> work;
  bool is_send = false;
  at::Tensor tensor;
  int tag = 0;
};

class World : public std::enable_shared_from_this<World> {
 public:
  World(int ranks, FakeMatching matching, std::chrono::milliseconds timeout, std::string name,
        bool like_nccl)
      : ranks_(ranks),
        matching_(matching),
        timeout_(timeout),
        name_(std::move(name)),
        like_nccl_(like_nccl),
        next_collective_(static_cast<size_t>(ranks), 0) {}

  const std::string& name() const noexcept { return name_; }

  int64_t sends_posted(int rank) {
    std::lock_guard<std::mutex> hold(mutex_);
    auto it = sends_posted_.find(rank);
    return it == sends_posted_.end() ? 0 : it->second;
  }

  c10::intrusive_ptr<c10d::Work> send(int from, int to, int tag, const at::Tensor& tensor) {
    check_peer(from, to, "send to");
    {
      std::lock_guard<std::mutex> hold(mutex_);
      ++sends_posted_[from];
    }
    Op op{make_work(from, c10d::OpType::SEND,
                    c10::str("rank ", from, "'s send to rank ", to, " (tag ", tag, ", ",
                             shape_of(tensor), ")")),
          true, tensor, tag};
    auto work = op.work;
    std::lock_guard<std::mutex> hold(mutex_);
    if (torn_down_) {
      work->complete(torn_down_);
      return work;
    }
    if (matching_ == FakeMatching::ByTag) {
      // Buffered: the caller may reuse its tensor at once.
      op.tensor = tensor.detach().clone();
      op.work->complete();
      auto& waiting = recvs_[{from, to, tag}];
      if (waiting.empty()) {
        sends_[{from, to, tag}].push_back(std::move(op));
      } else {
        Op recv = std::move(waiting.front());
        waiting.pop_front();
        transfer(from, to, op, recv);
      }
    } else {
      queues_[{from, to}].push_back(std::move(op));
      progress(from, to);
    }
    return work;
  }

  c10::intrusive_ptr<c10d::Work> recv(int self, int from, int tag, const at::Tensor& tensor) {
    check_peer(self, from, "recv from");
    Op op{make_work(self, c10d::OpType::RECV,
                    c10::str("rank ", self, "'s recv from rank ", from, " (tag ", tag, ", ",
                             shape_of(tensor), ")")),
          false, tensor, tag};
    auto work = op.work;
    std::lock_guard<std::mutex> hold(mutex_);
    if (torn_down_) {
      work->complete(torn_down_);
      return work;
    }
    if (matching_ == FakeMatching::ByTag) {
      auto& sent = sends_[{from, self, tag}];
      if (sent.empty()) {
        recvs_[{from, self, tag}].push_back(std::move(op));
      } else {
        Op send = std::move(sent.front());
        sent.pop_front();
        transfer(from, self, send, op);
      }
    } else {
      queues_[{self, from}].push_back(std::move(op));
      progress(self, from);
    }
    return work;
  }

  // allreduce (SUM, `tensor` defined) or barrier (undefined), the k-th
  // collective of each rank meeting the k-th of every other.
  c10::intrusive_ptr<c10d::Work> collective(int self, const std::string& kind,
                                            const at::Tensor& tensor) {
    std::lock_guard<std::mutex> hold(mutex_);
    const int64_t seq = next_collective_[static_cast<size_t>(self)]++;
    auto work = make_work(self, tensor.defined() ? c10d::OpType::ALLREDUCE : c10d::OpType::BARRIER,
                          c10::str("rank ", self, "'s ", kind, " #", seq));
    auto& c = collectives_[seq];
    if (c.works.empty()) {
      c.kind = kind;
      c.works.resize(static_cast<size_t>(ranks_));
      c.tensors.resize(static_cast<size_t>(ranks_));
    }
    c.works[static_cast<size_t>(self)] = work;
    c.tensors[static_cast<size_t>(self)] = tensor;
    ++c.arrived;
    if (c.kind != kind) c.mismatch = c10::str("rank ", self, " called ", kind, " where another "
                                              "rank called ", c.kind, " (collective #", seq, ")");
    if (c.arrived == ranks_) {
      std::exception_ptr failure;
      if (!c.mismatch.empty()) {
        failure = error("fake process group (", name_, "): ", c.mismatch,
                        "; every rank must issue the same collectives in the same order");
      } else if (tensor.defined()) {
        // Summed in rank order: every rank gets the same bits.
        at::Tensor sum = c.tensors[0].clone();
        for (int r = 1; r < ranks_; ++r) {
          const auto& t = c.tensors[static_cast<size_t>(r)];
          if (t.sizes() != sum.sizes() || t.scalar_type() != sum.scalar_type()) {
            failure = error("fake process group (", name_, "): allreduce #", seq, " got ",
                            shape_of(c.tensors[0]), " on rank 0 but ", shape_of(t), " on rank ",
                            r, "; give every rank the same shape and dtype");
            break;
          }
          sum.add_(t);
        }
        if (!failure) {
          for (auto& t : c.tensors) t.copy_(sum);
        }
      }
      for (auto& w : c.works) w->complete(failure);
      collectives_.erase(seq);
    }
    return work;
  }

  // Takes `work` off whatever queue holds it; a completed op stays done.
  // With like_nccl (NCCL's abort: ncclCommAbort), fails every op of
  // the world instead, pending and later.
  void abort(FakeWork* work) {
    std::lock_guard<std::mutex> hold(mutex_);
    if (like_nccl_) {
      if (!torn_down_) {
        torn_down_ = error("fake process group (", name_, "): ", work->what(),
                           " was aborted, which tears the communicator down as NCCL's abort "
                           "does: every op of every rank fails");
      }
      auto fail_all = [&](auto& queues) {
        for (auto& [key, queue] : queues) {
          for (auto& op : queue) op.work->complete(torn_down_);
        }
        queues.clear();
      };
      fail_all(sends_);
      fail_all(recvs_);
      fail_all(queues_);
      for (auto& [seq, c] : collectives_) {
        for (auto& w : c.works) {
          if (w) w->complete(torn_down_);
        }
      }
      collectives_.clear();
      work->complete(torn_down_);
      return;
    }
    auto take = [&](auto& queues) {
      for (auto& [key, queue] : queues) {
        for (auto it = queue.begin(); it != queue.end(); ++it) {
          if (it->work.get() != work) continue;
          queue.erase(it);
          return true;
        }
      }
      return false;
    };
    if (!take(recvs_)) take(sends_);
    for (auto& [key, queue] : queues_) {
      for (auto it = queue.begin(); it != queue.end(); ++it) {
        if (it->work.get() != work) continue;
        queue.erase(it);
        work->aborted();
        progress(key.first, key.second);
        return;
      }
    }
    work->aborted();
  }

  // What a stuck op waits for: under ByOrder both queues of its pair.
  std::string stall(const FakeWork* work) {
    std::lock_guard<std::mutex> hold(mutex_);
    if (matching_ == FakeMatching::ByTag) {
      return "no matching send arrived (same source and tag)";
    }
    for (auto& [key, queue] : queues_) {
      for (const auto& op : queue) {
        if (op.work.get() != work) continue;
        return c10::str("in-order queues (head first): rank ", key.first, " -> rank ", key.second,
                        ": ", listed(queue), "; rank ", key.second, " -> rank ", key.first, ": ",
                        listed(queues_[{key.second, key.first}]),
                        " (a send meets the peer's next recv only when both head their queues)");
      }
    }
    return "its peers never issued the matching op";
  }

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 private:
  struct Collective {
    std::string kind;
    std::string mismatch;
    std::vector<at::Tensor> tensors;
    std::vector<c10::intrusive_ptr<FakeWork>> works;
    int arrived = 0;
  };

  c10::intrusive_ptr<FakeWork> make_work(int rank, c10d::OpType type, std::string what) {
    return c10::make_intrusive<FakeWork>(rank, type, std::move(what), weak_from_this(), timeout_,
                                         like_nccl_);
  }

  void check_peer(int self, int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < ranks_ && peer != self, "fake process group: rank ", self,
                " cannot ", op, " rank ", peer, " in a group of ", ranks_, " ranks");
  }

  static std::string listed(const std::deque<Op>& queue) {
    std::ostringstream s;
    s << "[";
    for (size_t k = 0; k < queue.size(); ++k) {
      s << (k ? ", " : "") << (queue[k].is_send ? "send " : "recv ") << shape_of(queue[k].tensor);
    }
    s << "]";
    return s.str();
  }

  // Moves the bytes of a matched pair and completes both (under mutex_).
  void transfer(int from, int to, Op& send, Op& recv) {
    if (send.tensor.sizes() != recv.tensor.sizes() ||
        send.tensor.scalar_type() != recv.tensor.scalar_type()) {
      auto failure =
          error("fake process group (", name_, "): rank ", from, " sent ", shape_of(send.tensor),
                " (tag ", send.tag, ") to rank ", to, ", whose matching recv (tag ", recv.tag,
                ") expects ", shape_of(recv.tensor), "; the two ends must agree on every message");
      send.work->complete(failure);
      recv.work->complete(failure);
      return;
    }
    recv.tensor.copy_(send.tensor);
    // Let go of both tensors before the works say done, as a real backend
    // has by then: a waiter woken by complete() may count the references
    // to its tensor at once (the transport's release tests do).
    send.tensor = at::Tensor();
    recv.tensor = at::Tensor();
    send.work->complete();
    recv.work->complete();
  }

  // ByOrder: while the heads of a pair's two queues are a send and a recv,
  // they meet.
  void progress(int a, int b) {
    auto& mine = queues_[{a, b}];
    auto& theirs = queues_[{b, a}];
    while (!mine.empty() && !theirs.empty() && mine.front().is_send != theirs.front().is_send) {
      Op x = std::move(mine.front());
      Op y = std::move(theirs.front());
      mine.pop_front();
      theirs.pop_front();
      if (x.is_send) {
        transfer(a, b, x, y);
      } else {
        transfer(b, a, y, x);
      }
    }
  }

  const int ranks_;
  const FakeMatching matching_;
  const std::chrono::milliseconds timeout_;
  const std::string name_;
  const bool like_nccl_;
  std::exception_ptr torn_down_;  // set by the first abort under like_nccl_
  std::mutex mutex_;
  // ByTag: unmatched sends and receives per (source, destination, tag).
  std::map<std::tuple<int, int, int>, std::deque<Op>> sends_;
  std::map<std::tuple<int, int, int>, std::deque<Op>> recvs_;
  // ByOrder: per (rank, peer), that rank's ops with that peer, in order.
  std::map<std::pair<int, int>, std::deque<Op>> queues_;
  std::map<int64_t, Collective> collectives_;
  std::vector<int64_t> next_collective_;
  std::map<int, int64_t> sends_posted_;  // per rank, every send ever posted
};

bool FakeWork::wait(std::chrono::milliseconds timeout) {
  const auto limit = timeout == ::kNoTimeout ? timeout_ : timeout;
  {
    std::unique_lock<std::mutex> hold(lock_);
    if (like_nccl_ && (opType_ == c10d::OpType::SEND || opType_ == c10d::OpType::RECV)) {
      if (state_ == State::Failed) std::rethrow_exception(error_);
      return state_ != State::Aborted;
    }
    if (done_.wait_for(hold, limit, [&] { return state_ != State::Pending; })) {
      if (state_ == State::Aborted) return false;
      if (state_ == State::Failed) std::rethrow_exception(error_);
      return true;
    }
  }
  auto world = world_.lock();
  std::rethrow_exception(error("fake process group: ", what_, " did not complete within ",
                               limit.count(), " ms: ",
                               world ? world->stall(this) : std::string("its world is gone"),
                               "; a deadlock, or a rank that never issued its side"));
  return false;  // not reached
}

void FakeWork::abort() {
  if (auto world = world_.lock()) {
    world->abort(this);
  } else {
    aborted();
  }
}

class FakeBackend final : public c10d::Backend {
 public:
  FakeBackend(int rank, int size, std::shared_ptr<World> world)
      : c10d::Backend(rank, size), world_(std::move(world)) {}

  const std::string getBackendName() const override { return world_->name(); }
  int64_t sends_posted() { return world_->sends_posted(getRank()); }

  // The group's timeout, as Gloo's and NCCL's options carry it.
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(world_->name(), world_->timeout());
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    TORCH_CHECK(tensors.size() == 1, "fake process group: send takes one tensor, got ",
                tensors.size());
    return world_->send(getRank(), dst, tag, tensors[0]);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    TORCH_CHECK(tensors.size() == 1, "fake process group: recv takes one tensor, got ",
                tensors.size());
    return world_->recv(getRank(), src, tag, tensors[0]);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK(tensors.size() == 1, "fake process group: allreduce takes one tensor, got ",
                tensors.size());
    TORCH_CHECK(static_cast<c10d::ReduceOp::RedOpType>(opts.reduceOp) == c10d::ReduceOp::SUM,
                "fake process group: allreduce sums only; pass ReduceOp::SUM");
    return world_->collective(getRank(), "allreduce", tensors[0]);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    return world_->collective(getRank(), "barrier", at::Tensor());
  }

 private:
  std::shared_ptr<World> world_;
};

class FakeProcessGroup final : public c10d::ProcessGroup {
 public:
  FakeProcessGroup(int rank, int size, std::string name, c10::intrusive_ptr<c10d::Backend> backend)
      : c10d::ProcessGroup(rank, size), name_(std::move(name)) {
    const auto type = name_ == "gloo" ? BackendType::GLOO : BackendType::CUSTOM;
    setBackend(c10::DeviceType::CPU, type, backend);
    setBackend(c10::DeviceType::CUDA, type, backend);
    setDefaultBackend(type);
  }

  const std::string getBackendName() const override { return name_; }

  // The base class's barrier builds its tensor in a static shared by every
  // caller: ranks as threads would race on it.
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return getDefaultBackend()->barrier(opts);
  }

 private:
  std::string name_;
};

}  // namespace

int64_t sends_posted(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  auto* backend = dynamic_cast<FakeBackend*>(group->getDefaultBackend().get());
  TORCH_CHECK(backend != nullptr, "sends_posted: not a fake process group");
  return backend->sends_posted();
}

std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> make_fake_groups(
    int ranks, FakeMatching matching, std::chrono::milliseconds timeout, std::string backend_name,
    bool like_nccl) {
  TORCH_CHECK(ranks >= 1, "make_fake_groups needs at least 1 rank, got ", ranks);
  if (backend_name.empty()) backend_name = matching == FakeMatching::ByTag ? "gloo" : "fake_nccl";
  auto world = std::make_shared<World>(ranks, matching, timeout, backend_name, like_nccl);
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  for (int r = 0; r < ranks; ++r) {
    groups.push_back(c10::make_intrusive<FakeProcessGroup>(
        r, ranks, backend_name, c10::make_intrusive<FakeBackend>(r, ranks, world)));
  }
  return groups;
}

std::vector<std::string> run_ranks(int ranks, const std::function<void(int rank)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (errors[static_cast<size_t>(r)].empty()) errors[static_cast<size_t>(r)] = "(empty error)";
      } catch (...) {
        errors[static_cast<size_t>(r)] = "(unknown error)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace gpipe_test
