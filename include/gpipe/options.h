// options.h — how a Pipe cuts a model and a batch: balance, devices, chunks, batch dims, checkpoint, schedule, tracing, threads.
#pragma once

#include <gpipe/trace.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace gpipe {

/// Which micro-batches keep only their stage-boundary input in forward and
/// recompute the rest just before their backward.
enum class Checkpoint {
  /// Every micro-batch: least memory, one extra forward per cell.
  Always,
  /// Every micro-batch but the last, whose backward runs first anyway.
  ExceptLast,
  /// None: every cell keeps its autograd graph (fastest, most memory).
  Never,
};

/// "always", "except_last" or "never".
std::string to_string(Checkpoint checkpoint);
/// Writes `to_string(checkpoint)`.
std::ostream& operator<<(std::ostream& stream, Checkpoint checkpoint);

/// The order in which `Pipe::train_step` runs the forwards and backwards of
/// a mini-batch's micro-batches (`forward` always runs GPipe's). For K
/// stages and M micro-batches, with a backward twice a forward:
enum class Schedule {
  /// GPipe: every forward, then every backward. Bubble (K-1)/(M+K-1); each
  /// stage holds all M micro-batches' activations at the turn.
  GPipe,
  /// 1F1B (PipeDream-flush): after K-1-j warm-up forwards stage j runs one
  /// forward and one backward in turn. GPipe's bubble, but at most K-j
  /// micro-batches' activations per stage.
  OneFOneB,
  /// Megatron-LM's interleaved 1F1B: `virtual_stages` stages per device,
  /// bubble (K-1)/v of 1F1B's, more hand-offs.
  Interleaved1F1B,
  /// Zero-bubble ZB-H1 (Qi et al., 2024): each backward split into the
  /// input-grad half and the weight-grad half; the weight halves fill the
  /// drain. About a third of 1F1B's bubble at 1F1B's memory.
  ZBH1,
  /// Zero-bubble ZB-V (Qi et al., 2024): two stages per device in a V
  /// (device w runs stages w and 2W-1-w, so the first and the last stage
  /// share device 0), each backward split as in ZB-H1. Near-zero bubble at
  /// 1F1B's activation memory; `virtual_stages` is 2 (balance has 2W
  /// entries). Over a group, rank r runs stages r and 2R-1-r: rank 0 is
  /// both the first and the last.
  ZBV,
};

/// "gpipe", "1f1b", "interleaved_1f1b", "zb_h1" or "zb_v".
std::string to_string(Schedule schedule);
/// Writes `to_string(schedule)`.
std::ostream& operator<<(std::ostream& stream, Schedule schedule);

/// Options for `gpipe::Pipe`.
///
/// Example:
/// ```
/// gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({2, 2}).chunks(8));
/// ```
struct PipeOptions {
  /// Layers per stage, in order; one entry per stage, each at least 1,
  /// summing to the number of layers. Empty: computed for one stage per
  /// device, by profiled time when `sample` is given, else by parameter
  /// count (see balance.h).
  TORCH_ARG(std::vector<int64_t>, balance) = {};
  /// One device per worker, i.e. per stage unless `virtual_stages` > 1
  /// (extra ones are ignored with one stage per device, and refused with
  /// several, e.g. under zb_v: every device given is used). Empty: the available CUDA
  /// devices in order, or the CPU for every stage when there is no CUDA
  /// (then `balance` must be given, or the devices, to fix the stage count).
  TORCH_ARG(std::vector<c10::Device>, devices) = {};
  /// A sample mini-batch to balance by time when `balance` is empty.
  TORCH_ARG(at::Tensor, sample) = {};
  /// Micro-batches per mini-batch. At least 1. A batch of `rows` rows is cut
  /// into `chunks` pieces whose sizes differ by at most one, the larger
  /// first (17 rows, chunks 16: 2, then fifteen 1s); into `rows` pieces of
  /// one row when it has fewer rows; a 0-row batch is one empty piece.
  TORCH_ARG(int64_t, chunks) = 1;
  /// Where the batch dimension lies in the input: **dim 0 by default**.
  /// One entry serves every input value, otherwise one entry per value of
  /// `forward_tuple`'s input; a negative dim counts from the end;
  /// `std::nullopt` marks a value that is not cut: every micro-batch gets
  /// all of it (a shared mask, a lookup table) and its grad is summed over
  /// them. A sequence-first model (`[seq, batch, features]`) takes
  /// `batch_dim(1)`; with a shared mask, `batch_dim({1, std::nullopt})`.
  TORCH_ARG(std::vector<std::optional<int64_t>>, batch_dim) = {0};

 public:
  /// One batch dim for every input value: `batch_dim(1)`.
  PipeOptions& batch_dim(int64_t dim) {
    return batch_dim(std::vector<std::optional<int64_t>>{dim});
  }
  /// Where the micro-batches' outputs are joined, entries as in
  /// `batch_dim`; `std::nullopt` marks an output returned from micro-batch 0
  /// alone (one that does not depend on the cut inputs, e.g. a mask passed
  /// on). Empty (the default): `batch_dim`'s entry when it has one, else its
  /// first dim that is not `std::nullopt`, for every output.
  TORCH_ARG(std::vector<std::optional<int64_t>>, output_batch_dim) = {};

 public:
  /// One output batch dim for every output value: `output_batch_dim(1)`.
  PipeOptions& output_batch_dim(int64_t dim) {
    return output_batch_dim(std::vector<std::optional<int64_t>>{dim});
  }
  /// Which micro-batches are checkpointed in training.
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::ExceptLast;
  /// A mode per stage, in place of `checkpoint` (empty: `checkpoint` for
  /// every stage): under 1F1B-like schedules stage 0 holds K micro-batches
  /// in flight and the last stage 1, so early stages may checkpoint while
  /// later ones keep their graphs, e.g. {Always, ExceptLast, Never, Never}.
  TORCH_ARG(std::vector<Checkpoint>, stage_checkpoints) = {};
  /// Record every cell from the start (see `PipeImpl::trace`); tracing can
  /// also be switched on and off later with `PipeImpl::set_tracing`.
  TORCH_ARG(bool, trace) = false;
  /// The most recent events tracing keeps (whole steps; see gpipe::Trace).
  /// At least 1.
  TORCH_ARG(int64_t, trace_capacity) = kDefaultTraceCapacity;
  /// Intra-op threads (as `at::set_num_threads`) of each CPU stage's worker,
  /// fixed when the Pipe is built. 0: split the building thread's
  /// `at::get_num_threads()` between the CPU stages, at least 1 each, the
  /// first stages taking the remainder (5 threads, 2 stages: 3 and 2), so
  /// the stages do not oversubscribe the cores. N > 0: N per CPU stage. -1:
  /// leave torch's process-wide setting (every stage then uses all of it).
  /// Accelerator stages and the caller's own thread count are never changed.
  TORCH_ARG(int64_t, intra_op_threads) = 0;
  /// The order `train_step` runs micro-batches in (see gpipe::Schedule).
  /// 1F1B: GPipe's bubble with at most K micro-batches' activations alive.
  TORCH_ARG(Schedule, schedule) = Schedule::OneFOneB;
  /// Stages per device (worker), for `Schedule::Interleaved1F1B`: `balance`
  /// then has `virtual_stages` x W entries for W devices, and stage s runs
  /// on `devices[s % W]`. 1: one stage per device.
  TORCH_ARG(int64_t, virtual_stages) = 1;
  /// A schedule as data, in place of `schedule`: torch.distributed.pipelining's
  /// CSV format, one row of compute actions per device ("0F0,0F1,0B0,...";
  /// "0F3" forward of micro-batch 3 on stage 0, "1B2" backward, "1I2" / "1W2"
  /// its halves; empty cells idle). Its stages fix `virtual_stages`, its
  /// micro-batches must equal `chunks`; stage s runs on row s mod rows, or
  /// in ZB-V's V (row r: stages r and 2 rows - 1 - r) when the table places
  /// its 2 x rows stages so. A bad
  /// or deadlocking table throws ValueError naming the actions. Empty: use
  /// `schedule`. `Pipe::schedule_csv()` gives the table a pipe runs.
  TORCH_ARG(std::string, schedule_csv) = "";
};

}  // namespace gpipe
