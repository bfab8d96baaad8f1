// distributed_pipe.h — gpipe::DistributedPipe, a Sequential trained as a pipeline over the ranks of a c10d process group.
#pragma once

#include <gpipe/options.h>

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace gpipe {

namespace detail {
class Engine;
struct Batch;
}  // namespace detail

/// Options of a `DistributedPipe`.
struct DistributedPipeOptions {
  /// Options with `balance`, the rest at their defaults.
  /* implicit */ DistributedPipeOptions(std::vector<int64_t> balance)
      : balance_(std::move(balance)) {}
  /// Layers per stage: R * virtual_stages entries for a group of R ranks,
  /// summing to the Sequential's length; stage s runs on rank s mod R
  /// (under Schedule::ZBV in a V: rank r runs stages r and 2R-1-r).
  TORCH_ARG(std::vector<int64_t>, balance);
  /// Micro-batches per mini-batch; a batch needs at least this many rows
  /// (every rank runs this many).
  TORCH_ARG(int64_t, chunks) = 1;
  /// The plan of a step (see gpipe::Schedule).
  TORCH_ARG(Schedule, schedule) = Schedule::OneFOneB;
  /// Which micro-batches keep only their input and recompute before backward.
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::ExceptLast;
  /// A mode per stage (all ranks' stages), in place of `checkpoint` (see
  /// PipeOptions::stage_checkpoints).
  TORCH_ARG(std::vector<Checkpoint>, stage_checkpoints) = {};
  /// Stages per rank (interleaved_1f1b; 2 under zb_v, implied); 1 otherwise.
  TORCH_ARG(int64_t, virtual_stages) = 1;
  /// A schedule as data, in place of `schedule`, one row per rank (see
  /// PipeOptions::schedule_csv); every rank passes the same table.
  TORCH_ARG(std::string, schedule_csv) = "";
  /// The pipeline's ranks: a Gloo group (its world size 1 needs no
  /// backend). C++ programs make it with
  /// `gpipe::distributed::init_process_group` (gpipe/process_group.h) or
  /// get it from Python (`c10d::resolve_process_group(name)`).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, group);
  /// The group's ranks again (same order), for hand-offs to lower ranks:
  /// needed over NCCL, which runs a pair's sends and receives on one ordered
  /// queue, so hand-offs both ways on one group could wait on each other.
  /// Null: `group` (right for Gloo).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, reverse_group);
  /// This rank's stage replicas: each stage's grads are averaged over it
  /// once final, in buckets, overlapped with the rest of the step's
  /// backward (see docs/distributed.md); null for none.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, dp_group);
  /// With `dp_group`: the most MiB of grads averaged in one all_reduce (a
  /// parameter is never split).
  TORCH_ARG(double, bucket_cap_mb) = 25;
  /// How long this rank may wait for another within a step (a hand-off,
  /// the exchange that opens a step, its sends being taken) before the step
  /// fails, naming what it waited for, the schedule action (e.g. 3F0) and
  /// the rank that owes it; zero: the group's own timeout (Gloo's default
  /// is 30 minutes). See docs/distributed.md, Restarts.
  TORCH_ARG(std::chrono::milliseconds, step_timeout) = std::chrono::milliseconds(0);
  /// Where this rank's stages run.
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  /// Where the batch dimension lies in each input value, as
  /// `PipeOptions::batch_dim` (dim 0 by default; `std::nullopt`: a value
  /// every micro-batch gets whole). The target is cut along dim 0.
  TORCH_ARG(std::vector<std::optional<int64_t>>, batch_dim) = {0};
  /// One batch dim for every input value: `batch_dim(1)`.
  DistributedPipeOptions& batch_dim(int64_t dim) {
    return batch_dim(std::vector<std::optional<int64_t>>{dim});
  }
  /// Where the micro-batches' outputs are joined (eval_step), as
  /// `PipeOptions::output_batch_dim`.
  TORCH_ARG(std::vector<std::optional<int64_t>>, output_batch_dim) = {};
  /// One output batch dim for every output value.
  DistributedPipeOptions& output_batch_dim(int64_t dim) {
    return output_batch_dim(std::vector<std::optional<int64_t>>{dim});
  }
};

/// Runs a `torch::nn::Sequential` as a pipeline whose stages live on the
/// ranks of a process group, one step at a time over every rank (the same
/// engine and plans as `Pipe::train_step`; hand-offs by c10d isend/irecv).
/// Rank r keeps the layers of its stages, under the Sequential's names, and
/// drops the others. At construction the ranks compare their options and
/// their models' layers and parameters (every rank throws, naming what
/// differs), and a parameter used by layers on several ranks (tied weights)
/// gets a replica on each of them: the replicas start as the lowest such
/// rank's, and after every `train_step` each replica's grad is the sum over
/// all uses (an all_reduce over `group` in which the other ranks add zeros),
/// so that replicas stay equal. Stages run as `Pipe`'s do: tuples between stages, and
/// `gpipe::Skippable` layers with skips across ranks.
///
/// Example:
/// ```
/// gpipe::DistributedPipe pipe(model, gpipe::DistributedPipeOptions({2, 2}).chunks(4)
///                                        .group(group));
/// auto loss = pipe->train_step(pipe->is_first() ? x : torch::Tensor(),
///                              pipe->is_last() ? y : torch::Tensor(), torch::mse_loss);
/// ```
class DistributedPipeImpl : public torch::nn::Module {
 public:
  DistributedPipeImpl(torch::nn::Sequential sequential, DistributedPipeOptions options);
  ~DistributedPipeImpl() override;

  /// `loss_fn(output, target)` of one micro-batch: a scalar, mean-reduced
  /// over its rows.
  using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
  /// One training step on every rank: `input` on the first stage's rank,
  /// `target` on the last's (undefined elsewhere). Returns the batch's mean
  /// loss (detached) on the last stage's rank, undefined elsewhere; grads
  /// accumulate into this rank's parameters (averaged over `dp_group`,
  /// each stage's as soon as they are final). Bad arguments on any rank
  /// (a missing input or target, too few rows, a target cut unlike the
  /// input) throw on every rank before anything is sent, and the pipe works
  /// on; a failure during the step throws on every rank and later steps
  /// are refused (rebuild the group and the pipe).
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           const LossFn& loss_fn);
  /// Pipelined inference (no grads kept): the output on the last stage's
  /// rank, undefined elsewhere.
  torch::Tensor eval_step(const torch::Tensor& input);

  /// `loss_fn(outputs, targets)` of one micro-batch, for a Sequential that
  /// takes or returns several tensors: a scalar, mean-reduced over its rows.
  using TupleLossFn = std::function<torch::Tensor(const std::vector<torch::Tensor>& outputs,
                                                  const std::vector<torch::Tensor>& targets)>;
  /// `train_step` for several input tensors (the first layer takes
  /// std::vector<torch::Tensor>) and several outputs and targets, each cut
  /// into micro-batches along dim 0: `inputs` on the first stage's rank,
  /// `targets` on the last's (empty elsewhere).
  torch::Tensor train_step_tuple(std::vector<torch::Tensor> inputs,
                                 std::vector<torch::Tensor> targets, const TupleLossFn& loss_fn);
  /// `eval_step` for several inputs and outputs: every output on the last
  /// stage's rank, empty elsewhere.
  std::vector<torch::Tensor> eval_step_tuple(std::vector<torch::Tensor> inputs);

  /// This rank's index in the group.
  int64_t rank() const noexcept { return rank_; }
  /// The indices of the stages this rank holds.
  const std::vector<int64_t>& stages() const noexcept { return stages_; }
  /// Whether this rank holds stage 0 (it takes the input).
  bool is_first() const noexcept { return is_first_; }
  /// Whether this rank holds the last stage (it takes the target).
  bool is_last() const noexcept { return is_last_; }
  /// The order `train_step` runs on every rank, as a CSV table (one row per
  /// rank; see PipeOptions::schedule_csv).
  std::string schedule_csv();
  /// The options it was built with.
  const DistributedPipeOptions& options() const noexcept { return options_; }

 private:
  /// A training step with batches (empty where this rank has no input or
  /// target); `name` is the public call, for errors.
  torch::Tensor run_train_step(detail::Batch input, detail::Batch target,
                               const std::function<torch::Tensor(const detail::Batch&,
                                                                 const detail::Batch&)>& fn,
                               const char* name);

  DistributedPipeOptions options_;
  int64_t rank_ = 0;
  std::vector<int64_t> stages_;
  bool is_first_ = false;
  bool is_last_ = false;
  std::shared_ptr<detail::Engine> engine_;
};

/// A `DistributedPipeImpl` held by shared pointer, as torch's module holders.
TORCH_MODULE(DistributedPipe);

}  // namespace gpipe
