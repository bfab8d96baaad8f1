// reduce.cpp — GradReducer: buckets of final grads all-reduced over the data group, a status exchange so no replica waits for a failed one.
#include "reduce.h"

#include "check.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <unordered_set>
#include <utility>

namespace gpipe::detail {

GradReducer::GradReducer(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device status_device,
                         int64_t bucket_cap_bytes)
    : group_(std::move(group)), status_device_(status_device), cap_(kDefaultBucketCapBytes) {
  set_bucket_cap(bucket_cap_bytes);
}

void GradReducer::set_bucket_cap(int64_t bytes) {
  GPIPE_CHECK_VALUE(bytes >= 1, "the gradient bucket cap must be at least 1 byte, got ", bytes,
                    "; pass e.g. 25 MiB (bucket_cap_mb=25), the default");
  cap_ = bytes;
}

void GradReducer::begin(const Plan& plan, int64_t list, const std::vector<int64_t>& stages) {
  TORCH_CHECK(stages.size() <= 64, "gradient averaging handles up to 64 stages per rank, got ",
              stages.size(), "; use fewer virtual stages");
  state_ = State::Running;
  peer_failure_.clear();
  stages_ = stages;
  const auto& tasks = plan.lists.at(static_cast<size_t>(list));
  list_size_ = static_cast<int64_t>(tasks.size());
  position_ = 0;
  last_forward_ = -1;
  final_.assign(stages.size(), -1);
  for (int64_t p = 0; p < list_size_; ++p) {
    const Task& t = tasks[static_cast<size_t>(p)];
    if (t.op == Op::F) {
      last_forward_ = p;
      continue;
    }
    const auto it = std::find(stages_.begin(), stages_.end(), t.stage);
    TORCH_INTERNAL_ASSERT(it != stages_.end(), "task of stage ", t.stage, " on this rank");
    final_[static_cast<size_t>(it - stages_.begin())] = p;  // I, B or W: the last one wins
  }
  // A stage can start early once its grads are final and every leaf of
  // this rank is known, i.e. after this rank's last forward.
  early_.clear();
  for (size_t j = 0; j < stages.size(); ++j) {
    if (final_[j] > last_forward_) early_.push_back(j);
  }
  std::sort(early_.begin(), early_.end(), [&](size_t a, size_t b) { return final_[a] < final_[b]; });
  leaves_.clear();
  leaf_index_.clear();
  groups_.clear();
  launched_ = 0;
  launches_.clear();
}

void GradReducer::add_leaf(const at::Tensor& variable, size_t stage, bool late) {
  auto [it, added] = leaf_index_.emplace(variable.unsafeGetTensorImpl(), leaves_.size());
  if (added) leaves_.push_back(Leaf{variable, 0, false});
  Leaf& leaf = leaves_[it->second];
  if (stage < 64) leaf.stages |= uint64_t{1} << stage;
  leaf.late = leaf.late || late;
}

// A tensor computed outside the cells (from a parameter, say) hands its grad
// on at the end of the step: the leaves behind it are late.
void GradReducer::add_late_leaves(const torch::autograd::Edge& edge) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{edge.function.get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      add_leaf(acc->variable, 64, /*late=*/true);
      continue;
    }
    // Reverse order keeps a depth-first walk in next_edges order (the same
    // on every replica).
    const auto& next = node->next_edges();
    for (auto e = next.rbegin(); e != next.rend(); ++e) stack.push_back(e->function.get());
  }
}

void GradReducer::task_done(const Task& task, const Cut* cut) {
  if (state_ != State::Running && state_ != State::Launching) return;
  const int64_t p = position_++;
  if (task.op == Op::F && cut != nullptr) {
    const size_t j =
        static_cast<size_t>(std::find(stages_.begin(), stages_.end(), task.stage) - stages_.begin());
    for (const auto& edge : cut->externals) {
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get())) {
        add_leaf(acc->variable, j, /*late=*/plain_accumulator(edge) == nullptr);
      } else if (edge.function) {
        add_late_leaves(edge);
      }
    }
    return;
  }
  if (launched_ >= early_.size() || final_[early_[launched_]] != p) return;
  if (state_ == State::Running) lay_out();
  if (state_ != State::Launching) return;  // a replica failed: no buckets
  launch(launched_, /*zeros=*/false);
}

void GradReducer::lay_out() {
  // Each leaf goes with the reaching stage that finishes last; late leaves,
  // and those of stages that cannot start early, go with `finish`.
  std::vector<int64_t> group_of(stages_.size(), static_cast<int64_t>(early_.size()));
  for (size_t k = 0; k < early_.size(); ++k) group_of[early_[k]] = static_cast<int64_t>(k);
  groups_.assign(early_.size() + 1, {});
  using Key = std::tuple<int, int, int>;  // dtype, device type, device index
  std::vector<std::map<Key, size_t>> open(groups_.size());
  for (const Leaf& leaf : leaves_) {
    size_t g = early_.size();
    if (!leaf.late) {
      int64_t last = -1;
      for (size_t j = 0; j < stages_.size(); ++j) {
        if ((leaf.stages >> j & 1) != 0 && final_[j] > last) {
          last = final_[j];
          g = static_cast<size_t>(group_of[j]);
        }
      }
    }
    const at::Tensor& v = leaf.variable;
    const Key key{static_cast<int>(v.scalar_type()), static_cast<int>(v.device().type()),
                  v.device().index()};
    const int64_t bytes = static_cast<int64_t>(v.numel()) * static_cast<int64_t>(v.element_size());
    auto& buckets = groups_[g];
    auto it = open[g].find(key);
    if (it == open[g].end() ||
        (buckets[it->second].numel > 0 &&
         (buckets[it->second].numel * static_cast<int64_t>(v.element_size()) + bytes > cap_))) {
      buckets.emplace_back();
      it = open[g].insert_or_assign(key, buckets.size() - 1).first;
    }
    buckets[it->second].leaves.push_back(v);
    buckets[it->second].numel += v.numel();
  }
  state_ = exchange_status(false) ? State::Launching : State::Closed;
}

bool GradReducer::exchange_status(bool failed) {
  at::NoGradGuard no_grad;
  // On a GPU the status lives on a stream of its own: reading it on the
  // host (.cpu() waits for the current stream) then waits for the exchange
  // alone, not for the stage's compute stream, which would drain mid-step.
  // The status depends on no queued work, so nothing orders it after any.
  std::optional<c10::StreamGuard> on_side;
  if (!status_device_.is_cpu()) {
    if (!status_stream_) {
      status_stream_ = take_pool_stream(status_device_);
      status_held_ = hold({*status_stream_});
    }
    on_side.emplace(*status_stream_);
  }
  const int64_t size = group_->getSize();
  std::vector<at::Tensor> status{at::zeros({size}, at::TensorOptions(at::kLong).device(status_device_))};
  if (failed) status[0][group_->getRank()].fill_(1);
  group_->allreduce(status)->wait();
  const at::Tensor flags = status[0].cpu();
  std::ostringstream ranks;
  int64_t failures = 0;
  for (int64_t r = 0; r < size; ++r) {
    if (flags[r].item<int64_t>() == 0) continue;
    ranks << (failures++ ? ", " : "") << r;
  }
  if (failures == 0) return true;
  peer_failure_ = c10::str(
      "the step failed on data-parallel replica", failures > 1 ? "s" : "", " at rank",
      failures > 1 ? "s " : " ", ranks.str(), " of dp_group (its error says why); the grads of "
      "this step were not averaged, so the replicas differ now, and later steps are refused: "
      "destroy the process groups and build the pipes again");
  return false;
}

void GradReducer::launch(size_t group, bool zeros) {
  at::NoGradGuard no_grad;
  auto& buckets = groups_[group];
  // Check every grad before the first bucket starts: a group is started
  // whole or not at all (an abort then starts it with zeros).
  if (!zeros) {
    for (const auto& bucket : buckets) {
      for (const auto& v : bucket.leaves) {
        const at::Tensor& g = v.grad();
        TORCH_CHECK(!g.defined() || g.layout() == at::kStrided,
                    "gradient averaging over dp_group takes dense grads, but a parameter of "
                    "shape ", v.sizes(), " has a ", g.layout(), " grad; use dense grads (e.g. "
                    "nn.Embedding(sparse=False)) or train without dp_group");
      }
    }
  }
  for (auto& bucket : buckets) {
    std::vector<at::Tensor> pieces;
    pieces.reserve(bucket.leaves.size());
    for (const auto& v : bucket.leaves) {
      if (!zeros && slot_of_) {
        if (GradSlot* slot = slot_of_(v)) {
          std::lock_guard<std::mutex> hold(slot->mutex);
          slot->after_last_write(v.device());
        }
      }
      const at::Tensor& g = v.grad();
      pieces.push_back(zeros || !g.defined() ? at::zeros({v.numel()}, v.options())
                                             : g.reshape({-1}));
    }
    bucket.flat = at::cat(pieces);  // a fresh tensor, even of one piece
    std::vector<at::Tensor> flat{bucket.flat};
    bucket.work = group_->allreduce(flat);
  }
  const bool late = group == early_.size();
  launched_ = group + 1;
  if (late && buckets.empty()) return;
  launches_.push_back(Launch{late ? -1 : stages_[early_[group]],
                             late ? 0 : list_size_ - position_,
                             static_cast<int64_t>(buckets.size())});
}

void GradReducer::finish() {
  if (state_ == State::Running) lay_out();
  if (state_ != State::Launching) {
    state_ = State::Closed;
    TORCH_CHECK(peer_failure_.empty(), peer_failure_);
    return;
  }
  for (size_t g = launched_; g < groups_.size(); ++g) launch(g, /*zeros=*/false);
  state_ = State::Closed;
  for (auto& buckets : groups_) {
    for (auto& bucket : buckets) bucket.work->wait();
  }
  TORCH_CHECK(exchange_status(false), peer_failure_);
  at::NoGradGuard no_grad;
  const int64_t size = group_->getSize();
  for (auto& buckets : groups_) {
    for (auto& bucket : buckets) {
      bucket.flat.div_(size);
      int64_t at = 0;
      for (const auto& v : bucket.leaves) {
        const int64_t n = v.numel();
        at::Tensor g = v.grad();
        if (g.defined()) g.copy_(bucket.flat.narrow(0, at, n).view_as(g));
        at += n;
      }
      // Made on a stage's stream, last used on the current one: the
      // allocator must not hand the memory out before that use is done.
      if (!bucket.flat.is_cpu()) {
        c10::impl::VirtualGuardImpl impl(bucket.flat.device().type());
        impl.recordDataPtrOnStream(bucket.flat.storage().data_ptr(),
                                   impl.getStream(bucket.flat.device()));
      }
      bucket.flat = at::Tensor();
      bucket.work.reset();
    }
  }
}

void GradReducer::abort() noexcept {
  try {
    if (state_ == State::Running) {
      exchange_status(true);
    } else if (state_ == State::Launching) {
      for (size_t g = launched_; g < groups_.size(); ++g) launch(g, /*zeros=*/true);
      for (auto& buckets : groups_) {
        for (auto& bucket : buckets) {
          if (bucket.work) bucket.work->wait();
        }
      }
      exchange_status(true);
    }
  } catch (...) {
    // The group itself failed: nothing more can be exchanged over it.
  }
  state_ = State::Closed;
  for (auto& buckets : groups_) buckets.clear();
}

}  // namespace gpipe::detail
