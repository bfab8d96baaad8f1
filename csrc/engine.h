// engine.h — the stages, their workers, and one forward call's run through the schedule.
#pragma once

#include "executor.h"
#include "graph.h"
#include "microbatch.h"
#include "plan.h"
#include "ranks.h"
#include "reduce.h"
#include "stage.h"
#include "trace.h"
#include "transport.h"
#include "transport_c10d.h"

#include <gpipe/error.h>
#include <gpipe/options.h>

#include <ATen/ThreadLocalState.h>
#include <c10/core/Device.h>
#include <c10/core/StreamGuard.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace gpipe::detail {

class Engine;

/// One forward call with a graph: what its backward needs. Held by the
/// PipeBackward node until the graph is freed.
struct PipeRun {
  std::shared_ptr<Engine> engine;
  int64_t microbatches = 0;
  /// cells[stage][microbatch]
  std::vector<std::vector<Cell>> cells;
  /// Every edge where some cell's graph reaches a tensor it did not make
  /// (parameters and the like), numbered: PipeBackward's edges after the
  /// inputs' edges, in this order.
  EdgeIndex externals;
  /// How each input value was cut into micro-batches, and how each output
  /// value was joined: their grads are joined and cut alike.
  std::vector<ValueCut> input_cuts;
  std::vector<ValueCut> output_cuts;
  /// The device of each input value: its grad goes back there.
  std::vector<c10::Device> input_devices;
  /// With several micro-batches (each with a version counter of its own):
  /// the caller's input tensors, watched from the end of the forward.
  VersionWatch input_watch;
  /// Per stage: whether some cell's graph reaches the stage's input, i.e.
  /// whether the stage passes any grad back.
  std::vector<bool> reaches_input;
  /// For each output value, the PipeBackward input slot of its grad (-1:
  /// not differentiable, no grad).
  std::vector<int64_t> output_slot;
  bool output_atomic = true;
  /// The caller's thread-local state (autocast and the rest) at forward
  /// time: recomputes run under it, as the first forward did.
  std::optional<at::ThreadLocalState> forward_state;
  /// The forward call's number in the trace (0 when not tracing).
  int64_t step = 0;
};

/// The stage's compute stream made current for a cell (nothing on CPU).
std::optional<c10::StreamGuard> on_compute_stream(const Stage& stage);
/// Which stages a backward running on the autograd engine thread of
/// accelerator index `thread` runs inline (the deadlock rule, engine_backward.cpp):
/// stage j when it lives on an accelerator of that index, or when its
/// cells' graphs have nodes there (`graph_devices[j]`, from their cuts).
std::vector<bool> stages_inline_on(c10::DeviceIndex thread,
                                   const std::vector<c10::Device>& stage_devices,
                                   const std::vector<std::vector<c10::Device>>& graph_devices);
/// How many of `microbatches` micro-batches (the first ones) `mode`
/// checkpoints.
int64_t checkpointed_microbatches(Checkpoint mode, int64_t microbatches);
/// `receive`, recorded as a copy when it moves anything across devices.
Batch receive_traced(Payload in, const Lane& lane, Tracer& tracer, int64_t step, int64_t stage,
                     int64_t microbatch);

/// A run's skip routes (see SkipRoute), looked up by stage.
struct Skips {
  std::vector<SkipRoute> routes;
  /// Per stage: the routes arriving there (popped), and those leaving
  /// (stashed), in route order.
  std::vector<std::vector<int64_t>> arriving;
  std::vector<std::vector<int64_t>> leaving;

  Skips() = default;
  /// Checks that every route runs forward between two of `stages` stages.
  Skips(std::vector<SkipRoute> routes, int64_t stages);
  bool empty() const noexcept { return routes.empty(); }
  int64_t size() const noexcept { return static_cast<int64_t>(routes.size()); }
};

/// Appends to `batch` what arrives at stage `stage` for micro-batch `i`
/// along `routes` (numbers into `skips.routes`) as `flow` (Skip: stashed
/// tensors, popped here; SkipGrad: their grads, back at the stashing
/// stage), moved to `lane`'s device. False once the hand-off is cancelled.
bool receive_skips(Transport& transport, Flow flow, const std::vector<int64_t>& routes,
                   int64_t stage, int64_t i, Batch& batch, const Lane& lane, Tracer& tracer,
                   int64_t step);
/// Takes the last `routes.size()` values off `batch` and sends each along
/// its route as `flow`: a Skip to the route's popping stage, a SkipGrad
/// back to its stashing stage.
void send_skips(Transport& transport, Flow flow, const std::vector<int64_t>& routes,
                const Skips& skips, int64_t i, Batch& batch,
                const std::vector<std::shared_ptr<c10::Event>>& ready);

/// A step's hand-offs over a process group, through `group`, recording each
/// one with another rank as a Send span (the sending stage's worker issuing
/// it) or a Receive span (the receiving stage's worker waiting for it) when
/// tracing is on. Hand-offs between two stages of this rank pass untraced.
class TracedTransport final : public Transport {
 public:
  TracedTransport(ProcessGroupTransport& group, const Skips& skips, Tracer& tracer, int64_t step)
      : group_(group), skips_(skips), tracer_(tracer), step_(step) {}
  void send(const Address& to, Payload payload) override;
  std::optional<Payload> receive(const Address& at) override;
  void cancel() override { group_.cancel(); }
  bool cancelled() const override { return group_.cancelled(); }

 private:
  /// The stage that sends to `a`.
  int64_t sender(const Address& a) const;

  ProcessGroupTransport& group_;
  const Skips& skips_;
  Tracer& tracer_;
  int64_t step_;
};

/// Intra-op threads of each stage's worker (0: torch's setting) for the
/// `intra_op_threads` option (see PipeOptions), splitting `available`
/// threads between the CPU stages among `devices` (one per stage).
std::vector<int> intra_op_split(const std::vector<c10::Device>& devices, int64_t option,
                                int available);

/// The plan kind a public gpipe::Schedule names.
PlanKind plan_kind(gpipe::Schedule schedule);

/// A schedule given as a table (`schedule_csv` options: torch's CSV format,
/// plan.h), parsed; none for "". Its stages per row fix `virtual_stages`
/// (1 is taken as unset). Throws ValueError naming the bad cell or action,
/// or `virtual_stages` when it disagrees.
std::optional<Plan> schedule_table(const std::string& csv, int64_t& virtual_stages);

/// How a pipe lays out its stages (Pipe: per device, DistributedPipe: per
/// rank): the table that replaces `schedule` (schedule_table), the stages
/// per worker, whether they lie in ZB-V's V (zb_v named, or a table placing
/// them so; 2 per worker, virtual_stages 1 taken as unset) and the plan
/// kind the engine is built with (a V table: ZBV, then set_plan).
struct StageLayout {
  std::optional<Plan> table;
  int64_t virtual_stages = 1;
  bool v_shape = false;
  PlanKind kind = PlanKind::OneFOneB;
};
/// Throws ValueError naming `virtual_stages` where the schedule runs
/// another number of stages per `per` ("device" or "rank").
StageLayout stage_layout(const std::string& csv, gpipe::Schedule schedule,
                         int64_t virtual_stages, const char* per);

/// train_step's loss: one micro-batch's output and target in, a scalar
/// (mean-reduced over the micro-batch's rows) out.
using LossFn = std::function<at::Tensor(const Batch& output, const Batch& target)>;

/// The process groups of a pipeline over ranks (all null: in-process).
struct Groups {
  /// The pipeline's ranks: stage s on rank s mod size.
  c10::intrusive_ptr<c10d::ProcessGroup> pipeline;
  /// The same ranks again, for hand-offs to a lower rank (grads, and
  /// interleaved activations wrapping around) where the backend runs a
  /// pair's sends and receives on one ordered queue (NCCL): hand-offs both
  /// ways on one group could then wait on each other. Null: `pipeline`.
  c10::intrusive_ptr<c10d::ProcessGroup> reverse;
  /// This rank's data-parallel replicas (the same stages on every member):
  /// each stage's grads are averaged over it once final, overlapped with
  /// the rest of the step (reduce.h); null for none. Needs `pipeline`.
  c10::intrusive_ptr<c10d::ProcessGroup> data;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  /// `layers[s]` and `devices[s]` for stage s; stage s runs on worker
  /// s mod (stages / virtual_stages). `intra_op_threads`: see PipeOptions;
  /// the calling thread's at::get_num_threads() is what 0 splits between the
  /// CPU workers. `plan`: the schedule train_step runs.
  ///
  /// With a pipeline group (`groups.pipeline`) of R ranks the pipeline spans the group: this
  /// rank (r) holds only its `virtual_stages` stages, stages r, r + R, ...
  /// of R * virtual_stages, in `layers` in that order, runs them on one
  /// worker, and hands batches to the other ranks over the group
  /// (transport_c10d.h). Only `train_step` and `eval_step` run then.
  Engine(std::vector<std::unique_ptr<Layers>> layers, const std::vector<c10::Device>& devices,
         int64_t chunks, Checkpoint checkpoint, int64_t intra_op_threads = 0,
         int64_t virtual_stages = 1, PlanKind plan = PlanKind::GPipe,
         Groups groups = {});

  /// Each stage worker's intra-op thread count as set (0: left to torch).
  const std::vector<int>& intra_op_threads() const noexcept { return intra_op_threads_; }

  /// Runs the forward half of the schedule. Under grad mode, when anything
  /// requires grad, the outputs hang off one PipeBackward node that runs the
  /// backward half. `training` selects checkpointing.
  Batch forward(const Batch& input, bool training);

  /// Runs the backward half for `run`: `grads` holds one grad per
  /// PipeBackward input slot; `needed` says which of PipeBackward's edges
  /// (one per input value, then one per `run.externals` edge) autograd
  /// wants. Returns one grad per edge: the input grads, then each external
  /// edge's grad summed over micro-batches (undefined where not needed).
  /// The external edges marked in `accumulate` lead to leaves' accumulators
  /// that autograd would only add into: their grads go straight into the
  /// leaves' `.grad`, micro-batch by micro-batch, and come back undefined;
  /// except where cells of several stages reach the leaf (a weight tied
  /// across stages): its grad comes back, summed in a fixed order (stage by
  /// stage), so seeded runs give bitwise the same `.grad`.
  std::vector<at::Tensor> backward(PipeRun& run, const std::vector<at::Tensor>& grads,
                                   bool keep_graph, const std::vector<bool>& needed,
                                   const std::vector<bool>& accumulate);

  /// One training step inside the pipeline: forward, loss, backward of
  /// every micro-batch, in the order of the engine's plan (see plan.h). The
  /// target is cut along dim 0 like the input; micro-batch i's loss counts
  /// rows_i / rows, so the returned loss (detached) is the whole batch's
  /// and every parameter's `.grad` gains what `loss.backward()` of the
  /// plain model would add. A failure anywhere throws a CellError naming
  /// stage, micro-batch and phase ("loss" for `loss_fn`).
  /// `training` selects checkpointing, as in `forward`.
  ///
  /// Over a process group every rank calls it: `input` matters on the rank
  /// of stage 0 only, `target` on the last stage's only (empty batches
  /// elsewhere), every rank runs `chunks` micro-batches, and the loss comes
  /// back on the last stage's rank (undefined elsewhere). Bad arguments on
  /// any rank throw on every rank before anything is sent (start_step), and
  /// later steps run. A failure during the step fails it on every rank,
  /// naming the rank where it started; later steps are refused (the group's
  /// point-to-point state is lost).
  at::Tensor train_step(const Batch& input, const Batch& target, const LossFn& loss_fn,
                        bool training);

  /// Pipelined inference (call under no-grad): every micro-batch forward
  /// through every stage in the plan's order of forwards, the outputs
  /// gathered as `forward` does. Over a process group: the output on the
  /// last stage's rank, an empty batch elsewhere.
  Batch eval_step(const Batch& input);

  /// Over a process group: takes part in the start of the step this rank
  /// was about to run (`training_step`: a train_step, else an eval_step)
  /// with error `what`, so that the other ranks, already in it, stop too
  /// (naming this rank and `what`) before anything is sent; the caller then
  /// raises its own error. For errors found before the step (bad arguments
  /// in the bindings). Nothing in-process.
  void abandon_step(const std::string& what, bool training_step);

  /// Over a process group: throws a ValueError on every rank where the
  /// ranks' `settings` differ (ranks.h); `what` names the pipe. Every rank
  /// calls it, before the first step.
  void check_agreement(const std::vector<Setting>& settings, const std::string& what);
  /// Over a process group: this rank's part in the parameters tied across
  /// ranks (ranks.h). Makes the replicas equal now (every rank calls it),
  /// and sums their grads at the end of every train_step.
  void set_ties(std::vector<Tie> ties);
  /// Replaces this rank's replicas of its ties (ranks.h, set_replicas),
  /// between steps.
  void set_tie_replicas(const std::vector<at::Tensor>& replicas);

  /// Makes train_step run `plan` (a schedule given as data, e.g.
  /// plan_from_csv; validated) instead of its kind's: one list per worker
  /// (over a group: per rank), the pipeline's stages, `chunks`
  /// micro-batches. Throws ValueError naming what does not match.
  void set_plan(Plan plan);
  /// The plan train_step runs for `microbatches` micro-batches (validated).
  const Plan& plan(int64_t microbatches);
  /// A checkpoint mode per stage (the pipeline's stages, over a group every
  /// rank's), in place of the engine's one mode: under 1F1B-like schedules
  /// early stages hold the most micro-batches in flight, so they may
  /// checkpoint while later ones keep their graphs. Throws ValueError for
  /// another count than the stages.
  void set_stage_checkpoints(std::vector<Checkpoint> modes);
  PlanKind plan_kind() const noexcept { return plan_kind_; }

  /// The stages this engine runs (over a group: this rank's).
  int64_t stages() const noexcept { return static_cast<int64_t>(stages_.size()); }
  /// The pipeline's stages in all (over a group: every rank's).
  int64_t all_stages() const noexcept { return all_stages_; }
  int64_t workers() const noexcept { return executor_.workers(); }
  /// The worker that runs stage `stage` of this process: stage mod W, or
  /// ZB-V's V (plan.h, v_placement).
  int64_t worker_of(int64_t stage) const noexcept {
    return placement_.empty() ? stage % workers() : placement_[static_cast<size_t>(stage)];
  }
  /// How batches travel between stages: "in-process", or over a group
  /// "tagged" (Gloo) or "ordered" (NCCL; see transport_c10d.h).
  const char* handoffs() const noexcept {
    return !transport_ ? "in-process" : transport_->ordered() ? "ordered" : "tagged";
  }

  /// Where inputs are cut and outputs joined (see `scatter` and `gather`):
  /// dim 0 of every value unless set. Set before the first run.
  /// An empty `output` joins every output along `input`'s single entry, or
  /// its first that is not `std::nullopt`.
  void set_batch_dims(BatchDims input, BatchDims output);
  /// How many micro-batches `input` makes.
  int64_t microbatches(const Batch& input) const {
    return static_cast<int64_t>(scatter(input, chunks_, input_dims_).microbatches.size());
  }

  /// The skip connections across stages (see SkipRoute): the stages'
  /// layers take and return the extra values. Set before the first run.
  void set_skip_routes(std::vector<SkipRoute> routes) {
    skips_ = Skips(std::move(routes), all_stages_);
  }
  const Skips& skips() const noexcept { return skips_; }

  /// Called with a failed run's error before it is thrown; may throw
  /// something else instead (the Python bindings raise the layer's own
  /// Python exception). Set before the first run.
  using ErrorHook = std::function<void(const CellError&)>;
  void set_error_hook(ErrorHook hook) { error_hook_ = std::move(hook); }

  /// A loss_fn call named in errors (the frontend's language: Python's
  /// bindings set `torch.nn.functional.mse_loss(output, target)`).
  void set_loss_example(std::string example) { loss_example_ = std::move(example); }

  /// With a data group: the most bytes in one bucket of grads averaged
  /// together (see reduce.h; default 25 MiB). Set between steps.
  void set_bucket_cap(int64_t bytes);
  /// Over a process group: how long this rank may wait for another (a
  /// hand-off, the exchange that starts a step, its sends being taken)
  /// before the step fails naming what it waited for; zero (the default):
  /// the group's own timeout. Set between steps.
  void set_step_timeout(std::chrono::milliseconds timeout);
  /// With a data group: when each of the last training step's buckets
  /// started, relative to this rank's list (empty without a data group).
  std::vector<GradReducer::Launch> grad_reduce_launches() const;

  /// Records every cell (and cross-device copy) while enabled.
  Tracer& tracer() noexcept { return tracer_; }

 private:
  /// Runs `schedule` on the workers, which run with `state`: the caller's
  /// thread-local state (grad mode, inference mode, autocast and the rest).
  std::vector<Payload> execute(const Schedule& schedule, std::vector<Payload> sources,
                               const CellFn& cell, const at::ThreadLocalState& state,
                               const std::vector<bool>& inline_stages);

  /// Every stage's lane, in stage order.
  std::vector<const Lane*> lanes() const;
  /// train_step's and eval_step's run: with `loss_fn` a training step
  /// returning the loss; without, forwards only, the last stage's outputs
  /// into `outputs`.
  at::Tensor step(const Batch& input, const Batch& target, const LossFn* loss_fn, bool training,
                  std::vector<Batch>* outputs);
  /// Starts a step's random draws (the RNG rule, rng.h): every stage
  /// relearns what it draws; with several micro-batches and a generator
  /// shared between workers, returns the step's seed (one draw from the
  /// caller's CPU generator), from which each cell's own streams are seeded.
  std::optional<uint64_t> begin_draws(int64_t microbatches);
  /// The index (of all_stages()) of each of stages_.
  std::vector<int64_t> stage_indices() const;
  /// Over a group, before a step's first hand-off: every rank's argument
  /// error and rows exchanged (ranks.h's exchange_step_start, and a flag
  /// over the data group for a training step). This rank rethrows `own`
  /// where its own arguments were bad (returns where `own` is null); the
  /// others throw a ValueError naming the rank; rows that differ between
  /// the input and the target throw on every rank. Nothing was sent, so the
  /// pipe works on.
  void start_step(const StepStart& mine, const std::exception_ptr& own, bool training_step);
  /// Whether this engine runs stage `stage` (of all_stages()).
  bool holds(int64_t stage) const noexcept {
    return !transport_ || transport_->owner(stage) == transport_->rank();
  }
  /// Index into stages_ of stage `stage` (of all_stages()). Over a group a
  /// rank's stages are s = rank + j*R in a loop, or rank and 2R-1-rank in
  /// ZB-V's V: either way stage / R is its index j among them.
  size_t local(int64_t stage) const noexcept {
    return static_cast<size_t>(transport_ ? stage / transport_->ranks() : stage);
  }
  /// One forward, backward or train_step at a time: other threads wait; a
  /// forward or train_step from inside a cell (a Pipe within a Pipe's layer)
  /// and a call from the thread already running this engine are refused at
  /// once.
  class Call {
   public:
    Call(Engine& engine, const char* what);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    Engine& engine_;
  };

  std::vector<std::unique_ptr<Stage>> stages_;
  int64_t all_stages_ = 0;
  /// Over a process group: the hand-offs between ranks; null in-process.
  std::unique_ptr<ProcessGroupTransport> transport_;
  // Grads are averaged over it (see Groups::data).
  c10::intrusive_ptr<c10d::ProcessGroup> data_group_;
  /// Averages the grads over data_group_ (of more than one rank); else null.
  std::unique_ptr<GradReducer> reducer_;
  /// Parameters shared with other ranks (after transport_: uses its group).
  std::unique_ptr<TiedParameters> ties_;
  /// Set by a failed step over a group: later ones are refused.
  std::string failed_;
  std::vector<int> intra_op_threads_;  // before executor_: it starts the workers with these
  std::mutex busy_;
  std::atomic<std::thread::id> owner_{};
  Executor executor_;
  int64_t chunks_;
  BatchDims input_dims_{0};
  BatchDims output_dims_{0};
  Checkpoint checkpoint_;
  // Per stage (all stages); empty: checkpoint_ for every stage.
  std::vector<Checkpoint> stage_checkpoints_;
  // How many micro-batches each stage (all stages) checkpoints in a step of
  // `microbatches` (zeros unless `training`), and whether any stage does.
  struct CheckpointStops {
    std::vector<int64_t> per_stage;
    bool any = false;
  };
  CheckpointStops checkpoint_stops(int64_t microbatches, bool training) const;
  /// Whether some default generator is drawn from by stages on several
  /// workers (the RNG rule, rng.h).
  bool shared_generators_ = false;
  int64_t virtual_stages_;
  /// placement_[s]: the worker of stage s; empty for the loop (s mod W).
  std::vector<int64_t> placement_;
  PlanKind plan_kind_;
  /// The last plan made, for its micro-batch count.
  std::optional<Plan> plan_;
  Skips skips_;
  ErrorHook error_hook_;
  std::string loss_example_ = "torch::mse_loss(output, target)";
  Tracer tracer_;
};

}  // namespace gpipe::detail
