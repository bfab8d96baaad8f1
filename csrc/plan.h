// plan.h — a training step's schedule as data: each worker's ordered F/B/I/W tasks; generators, validator, simulation. No torch.
//
// `train_step` runs the whole step inside the pipeline, so forwards and
// backwards may interleave. A plan gives each worker (one per device, or one
// per process) the tasks it runs, in order. Which worker runs each stage is
// part of the plan (`placement`): a loop by default, stage s of S on worker
// s mod W (S = v·W with v virtual stages per worker), or ZB-V's V, where
// worker w holds stages w and 2W-1-w. A task is
//
//   F(s, i)  forward of micro-batch i through stage s; on the last stage
//            followed by the loss of micro-batch i and its grad
//   B(s, i)  the whole backward of (s, i): input grads and weight grads
//   I(s, i)  zero-bubble's first half of B: the input grads only
//   W(s, i)  the second half: the weight grads, from what I kept
//
// and depends on
//
//   F(s, i)         F(s-1, i)                            (s > 0)
//   B(s, i), I(s,i) F(s, i), and B(s+1, i) or I(s+1, i)   (s < S-1)
//   W(s, i)         I(s, i)
//
// Data crosses workers only along these edges; a worker runs its list in
// order and blocks on a missing input, so a plan deadlocks exactly when
// these edges and the lists' orders make a cycle (`validate`).
//
//   1f1b, W = 4, M = 8, every task one tick (`render`):
//   worker 0: F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7
//   ...
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace gpipe::detail {

enum class Op : uint8_t { F, B, I, W };

struct Task {
  Op op;
  int64_t stage;
  int64_t microbatch;

  bool operator==(const Task& other) const = default;
};

/// "F3", "I0" (stage omitted: a worker's list names it by position), and
/// with the stage for logs and errors: `describe(task)` = "F(stage 2, micro-batch 3)".
std::ostream& operator<<(std::ostream& out, const Task& task);
std::string describe(const Task& task);

/// Which plan a Pipe's train_step runs (see gpipe::Schedule); Custom: a
/// plan given as data (`plan_from_csv`). ZBV places its stages in a V: the
/// in-process engine and the ranks run it (`placement_of`), and a CSV table
/// placing its stages in a V (`require_runnable_placement`).
enum class PlanKind : uint8_t { GPipe, OneFOneB, Interleaved1F1B, ZBH1, Custom, ZBV };

/// "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "custom", "zb_v".
std::string to_string(PlanKind kind);

struct Plan {
  PlanKind kind = PlanKind::GPipe;
  int64_t workers = 0;
  /// Stages in all: virtual stages per worker times workers.
  int64_t stages = 0;
  int64_t microbatches = 0;
  /// lists[w]: the tasks of worker w in the order it runs them.
  std::vector<std::vector<Task>> lists;
  /// placement[s]: the worker that runs stage s; empty for the loop, stage
  /// s on worker s mod W. Every worker holds stages / workers stages.
  std::vector<int64_t> placement;

  int64_t worker_of(int64_t stage) const noexcept {
    return placement.empty() ? stage % workers : placement[static_cast<size_t>(stage)];
  }
  /// Whether stage s runs on worker s mod W.
  bool loop_placement() const noexcept;
};

/// ZB-V's placement of 2W stages on W workers: stage s < W on worker s,
/// stage s >= W on worker 2W-1-s (so the first and the last stage share
/// worker 0, and the turn of the V, stages W-1 and W, worker W-1).
std::vector<int64_t> v_placement(int64_t workers);
/// The worker of each of the workers x virtual_stages stages a named
/// schedule runs: ZB-V's V, else a loop (stage s on worker s mod W).
std::vector<int64_t> placement_of(PlanKind kind, int64_t workers, int64_t virtual_stages);

/// The generators. Each throws std::invalid_argument naming the bad count
/// (workers, virtual stages or micro-batches below 1).
///
/// gpipe: every F in micro-batch order, then every B in reverse.
Plan gpipe_plan(int64_t workers, int64_t microbatches);
/// 1F1B (PipeDream-flush): W-w-1 warm-up forwards on worker w, then one
/// forward and one backward in turn, then the remaining backwards.
Plan one_f_one_b_plan(int64_t workers, int64_t microbatches);
/// Megatron-LM's interleaved 1F1B: v stages per worker (stage s on worker
/// s mod W), micro-batches in groups of W per stage.
Plan interleaved_1f1b_plan(int64_t workers, int64_t virtual_stages, int64_t microbatches);
/// ZB-H1 (Qi et al., ICLR 2024): 1F1B's order of F's and I's (each B split
/// into I and W), the W's deferred to fill the bubbles and the drain; no
/// worker holds more micro-batches in flight than 1F1B's busiest worker,
/// min(W, M) (1F1B's peak memory), though later workers hold more than
/// under 1F1B. With M >= W each worker idles (W - 1)(f + i - w) instead of
/// 1F1B's (W - 1)(f + b).
Plan zb_h1_plan(int64_t workers, int64_t microbatches);
/// ZB-V (Qi et al., ICLR 2024): 2W stages in a V (`v_placement`), every B
/// split into I and W. Laid out tick by tick with every task one tick: each
/// worker runs a ready I if it has one (its chunk-1 stage first, then the
/// oldest micro-batch: the backward's critical path), else a ready F (the
/// oldest micro-batch, chunk 1 first), else the oldest W it owes, else
/// idles. A worker admits at most min(W, M) micro-batches into its chunk-0
/// stage before their W's, so no worker holds more than 2·min(W, M)
/// (stage, micro-batch) pairs in flight, each half a 1F1B stage: 1F1B's
/// peak activation memory. Simulated with f = i = w (test_plan.cpp,
/// bench/sim): 0.965 of perfect at W = 8, M = 32.
Plan zb_v_plan(int64_t workers, int64_t microbatches);
/// The plan of `kind`; `virtual_stages` must be 1 except for interleaved
/// (any) and zb_v (2).
Plan make_plan(PlanKind kind, int64_t workers, int64_t virtual_stages, int64_t microbatches);

/// Throws std::invalid_argument naming the first problem: a task on the
/// wrong worker or out of range, a task missing or repeated (each (stage,
/// micro-batch) has one F and either one B or one I and one W), or a
/// deadlock (naming the tasks each blocked worker waits on).
void validate(const Plan& plan);

/// Durations of each kind of task, in any unit.
struct Costs {
  double f = 1;
  double b = 2;
  double i = 1;
  double w = 1;
};

struct Simulation {
  /// start[w][k]: when lists[w][k] starts, each task starting as soon as
  /// its inputs are there and its worker is free.
  std::vector<std::vector<double>> start;
  /// When the last task ends.
  double makespan = 0;
  /// Sum of every task's duration.
  double work = 0;
  /// Idle fraction of the workers until the makespan:
  /// 1 - work / (workers * makespan).
  double bubble = 0;
  /// Peak count per worker of (stage, micro-batch) pairs whose activations
  /// are held (from F until B, or until W when split). With v stages per
  /// worker each pair is 1/v of a one-stage-per-worker plan's.
  std::vector<int64_t> peak_in_flight;
};

/// torch.distributed.pipelining's CSV schedule format ("compute_only"): one
/// row per worker (rank), its compute actions in order, each
/// <stage><F|I|W|B><micro-batch> ("0F3", "1I2", "1W2", "0B1"); an empty cell
/// is an idle tick; DualPipeV's overlapped cell "(0F7;7B3)OVERLAP_F_B" is its
/// two actions, run one after the other in that order. Communication is
/// derived from the tasks, so the format's communication and FSDP actions
/// (SEND_F, RECV_B, UNSHARD, ...) are refused, naming them. Workers, stages and micro-batches are the rows and the
/// largest indices seen; each stage's tasks must all be in one row, which
/// gives the placement (a loop, a V, or any other with as many stages in
/// each row); the plan is checked with `validate`.
/// Throws std::invalid_argument naming the row, the cell and the fix.
Plan plan_from_csv(const std::string& text);
/// Whether `plan` places its stages in ZB-V's V (2W stages, v_placement).
bool v_placed(const Plan& plan);
/// What the engine runs: a loop (stage s on row s mod W) or ZB-V's V.
/// Throws std::invalid_argument naming the first stage placed otherwise.
void require_runnable_placement(const Plan& plan);
/// The plan as that CSV: one row per worker, no idle cells.
std::string plan_to_csv(const Plan& plan);

/// Runs `plan` on paper. Throws std::invalid_argument when it deadlocks.
Simulation simulate(const Plan& plan, const Costs& costs = {});

/// The plan as a picture, every task one tick: one line per worker,
/// "worker 0: F0 F1 .. B0", a cell per tick; with virtual stages a cell
/// also names the stage ("F0.1": micro-batch 0 on stage 1).
std::string render(const Plan& plan);

}  // namespace gpipe::detail
