// reduce.h — data parallelism: this rank's stage grads averaged over their replicas, in buckets, while the step's backward goes on.
//
// With a data group (Groups::data) every member runs the same stages on its
// own slice of the batch; after the step each parameter's `.grad` must be
// the replicas' mean, so that R replicas on batches x_1..x_R train exactly as
// one replica on their concatenation (equal slices). A stage's grads are
// final once this rank's list has run the stage's last grad-producing task
// (its last B, or last W under zb_h1): from then on nothing adds to them, so
// their all_reduce can run while the worker goes on with the other stages'
// backwards.
//
//   worker (interleaved, rank 0: stages 0 and 2)
//     ... B(2,3) | B(0,2) B(0,3)                         | finish: wait, / R, copy back
//                ^ stage_done(2): copy stage 2's grads into buckets, allreduce (async)
//   data group   |== allreduce stage 2's buckets ==|     ^ stage_done(0) ... ==|
//
// Which tensors: every leaf the stage's cells reached in their forwards (the
// AccumulateGrad edges of their cuts, graph.h), i.e. the parameters the step
// used; frozen parameters are reached by no graph and keep no grad. A leaf
// reached by two of this rank's stages (a tied weight) goes with the one
// finishing last. A leaf whose grad only lands at the end of the step (one
// with hooks, or one reached through a tensor computed outside the cells)
// is averaged at `finish`, as is a stage whose last grad task comes before
// this rank's last forward (then some leaves could still be unknown).
//
// Buckets: per stage, leaves in the order their cells reached them, grouped
// by dtype and device, at most `bucket_cap_bytes` each (a leaf is never
// split; a larger one makes a bucket of its own). A bucket is one flat
// tensor: each leaf's grad, or zeros where it has none; the zeros are not
// copied back, so a grad undefined on this rank stays undefined. The
// replicas run the same model on the same plan, so they reach the same
// leaves in the same order and agree on the buckets and on which grads are
// undefined; a model whose graph differs between replicas is not supported.
//
// Streams: the flat copy is made on the stage's compute stream (current when
// `stage_done` runs); c10d orders its own work after the current stream
// (NCCL) or runs it on the host (Gloo); `finish` waits for each bucket on the
// caller's current stream, divides and copies back there. No device-wide
// synchronisation.
//
// Failure: a failed step must not leave a replica waiting in an all_reduce
// its peer never starts. Every step therefore makes one small exchange of a
// status (who failed) before its first bucket: at the first launch point,
// once all of this rank's forwards have run and the buckets are known.
//   * A rank failing before it sends "failed" there; all ranks then skip the
//     buckets, and every rank's step fails.
//   * A rank failing after it runs the buckets it has not started yet (their
//     layout is known by then; contents zeros), then a second status
//     exchange, which ends every step (also a healthy one), reports it.
// So every member makes the same collectives in the same order, and no rank
// waits on a peer that left.
#pragma once

#include "graph.h"
#include "plan.h"
#include "streams.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpipe::detail {

/// 25 MiB, as torch's DistributedDataParallel.
inline constexpr int64_t kDefaultBucketCapBytes = int64_t{25} << 20;

class GradReducer {
 public:
  /// When a stage's buckets started, for tests and logs.
  struct Launch {
    /// The stage (of the whole pipeline); -1 for what `finish` starts.
    int64_t stage = -1;
    /// How many tasks of this rank's list were still to run.
    int64_t tasks_left = 0;
    /// Buckets started.
    int64_t buckets = 0;
  };

  /// Averages over `group` (size > 1). `status_device`: where the status
  /// exchange's tensor lives (CPU for Gloo; the stages' device for NCCL).
  GradReducer(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device status_device,
              int64_t bucket_cap_bytes = kDefaultBucketCapBytes);

  /// Bytes per bucket at most; throws c10::ValueError below 1.
  void set_bucket_cap(int64_t bytes);
  int64_t bucket_cap() const noexcept { return cap_; }

  /// Starts a step: this rank runs `plan.lists[list]`; its stage j is
  /// `stages[j]` of the whole pipeline.
  void begin(const Plan& plan, int64_t list, const std::vector<int64_t>& stages);
  /// After each task of the list, in order (not after a cancelled one): a
  /// forward's `cut` (F only) names the leaves its stage reaches. Starts the
  /// stage's buckets after its last grad task; call it with the stage's
  /// compute stream current.
  void task_done(const Task& task, const Cut* cut);
  /// After the step's last grad has landed (the caller's current stream
  /// ordered after the stages'): starts what is left, waits for every
  /// bucket, divides by the group's size and copies back into `.grad`.
  /// Throws when a replica failed this step (naming its rank in the group).
  void finish();
  /// A failed step (this rank's own failure): takes part in what is left of
  /// the step's exchanges so that no peer waits for it. Never throws; no-op
  /// once the step is finished or aborted. Without `begin` since the last
  /// step: a step failing before it started.
  void abort() noexcept;

  /// The launches of the last step, in order.
  const std::vector<Launch>& launches() const noexcept { return launches_; }

  /// A leaf's slot (graph.h), or null: the flat copy reads each leaf's
  /// `.grad` on the launching stage's stream, after the writes other stages
  /// queued on theirs (a weight tied across this rank's stages). Set for a
  /// step's duration (train_step's grad sinks live as long), then unset.
  using SlotOf = std::function<GradSlot*(const at::Tensor& leaf)>;
  void set_slots(SlotOf slot_of) { slot_of_ = std::move(slot_of); }

 private:
  struct Leaf {
    at::Tensor variable;
    /// Local stages reaching it (bit j: stage j).
    uint64_t stages = 0;
    /// Its grad lands at the end of the step only.
    bool late = false;
  };
  struct Bucket {
    std::vector<at::Tensor> leaves;
    int64_t numel = 0;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };
  enum class State : uint8_t { Idle, Running, Launching, Closed };

  void add_leaf(const at::Tensor& variable, size_t stage, bool late);
  void add_late_leaves(const torch::autograd::Edge& edge);
  /// Buckets per launch group (each early stage in the order it finishes,
  /// then the late group), and the first status exchange.
  void lay_out();
  /// Returns whether every member's step is still healthy.
  bool exchange_status(bool failed);
  void launch(size_t group, bool zeros);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::Device status_device_;
  /// Where the status exchange runs on a GPU (made on first use).
  std::optional<c10::Stream> status_stream_;
  HeldStreams status_held_;
  int64_t cap_;
  State state_ = State::Idle;
  std::string peer_failure_;

  // The step's plan, as this rank sees it.
  std::vector<int64_t> stages_;
  int64_t list_size_ = 0;
  int64_t position_ = 0;
  int64_t last_forward_ = -1;
  /// Per local stage: the position of its last grad task (-1: none).
  std::vector<int64_t> final_;
  /// Local stages started early, in the order they finish.
  std::vector<size_t> early_;

  // What the forwards reached.
  std::vector<Leaf> leaves_;
  std::unordered_map<const void*, size_t> leaf_index_;

  // Launch groups: groups_[k] for early_[k], then one for `finish`.
  std::vector<std::vector<Bucket>> groups_;
  size_t launched_ = 0;
  std::vector<Launch> launches_;
  SlotOf slot_of_;
};

}  // namespace gpipe::detail
