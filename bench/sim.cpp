// sim.cpp — schedule efficiency on simulated devices: layers that sleep t in forward and 2t in backward.
//
//   bench_sim [--quick] [--schedules] [--devices K]
//
// --schedules runs only the schedules' section (train_step at K=8, M=32;
// about 25 s): what tests/gpu/run.sh runs on a host with a core per
// simulated device. --devices K runs that section at K devices instead
// (K=2 on a 2-core machine gives each simulated device a core).
//
// Each stage holds one sleep layer (layers per stage L = 1): its forward
// sleeps t, its backward 2t, like a device busy with kernels while the CPU
// waits. A sleeping thread uses no core, so 8 stages "run" at once even on 2
// cores, and the makespan shows only the schedule and the engine's own
// overhead. checkpoint=never: recompute would add a forward (t) to each
// backward cell and change the ideal.
//
// For K stages and M micro-batches one mini-batch (forward + backward) takes
// at best (M + K - 1) * 3t * L; efficiency = that ideal / the measured
// median. Speedup compares the same K-layer model run as one stage (K=1,
// same M: all K*M*3t serial) with its K-stage pipeline.
//
// Sleeps overshoot (timer slack, wake-up latency), and on a VM the first
// microseconds after a wake-up run slowly; no scheduler can win that back.
// So timer slack is set to 1 ns (inherited by the workers, which the Pipe
// creates afterwards), and a reference runs the same sleep layer on the
// same M micro-batches in a plain loop on one thread, without gpipe:
// "eff(real cells)" divides by the ideal made of those real cell times,
// (M + K - 1) * (plain loop time / M) * L, and so shows what the schedule
// and the engine lose, apart from the machine.
//
// Schedules: then `train_step` (the whole step inside the pipeline, loss on
// the last stage) at K=8 devices, M=32 (quick: K=4, M=8), once per
// schedule, the four Pipes' steps interleaved so a slow spell hits all
// alike: gpipe, 1f1b, zb_h1 on K stages of one sleep layer (forward t,
// backward 2t) and interleaved_1f1b with v=2: 2K stages of half the work
// (forward t/2, backward t), stage s on device s mod K. The layer's
// backward sleeps t for its input's grad and t for its weight's grad, each
// only when the running backward asks for it (needs_input_grad): a full B
// sleeps 2t, zb_h1's I (input path only) t, and its W t. The input
// requires grad, so stage 0's backward also pays both halves. Every device
// has M x 3t of work, so "perfect" is M x 3t; each schedule's own bound
// is gpipe and 1f1b M/(M+K-1), interleaved M/(M+(K-1)/v), zb_h1
// 3M/(3M+K-1) of perfect; `simulate` (csrc/plan.h) runs the same plan on
// paper with these costs and should give those bounds exactly. "eff vs
// traced cells" divides instead by `simulate` with each kind of task costing
// the mean its cells took in one traced step of the same Pipe (naps run
// long on a busy VM): what the schedule and the engine lose, apart from
// this machine's timers. "bare" runs each schedule's plan again with bare
// threads (`bare_plan_time`: the same naps and hand-offs, no torch, no
// engine), interleaved with the Pipes' steps: "bare vs perfect" is the most
// any engine could show on this machine, "eff vs bare" what gpipe keeps of
// it.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include "bench.h"
#include "plan.h"

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Busy for `seconds` like a device: sleeps until shortly before the deadline
// (this VM's timers wake ~50 us late), then yields until it passes, so a nap
// lasts t rather than t plus the timer's lateness.
void nap(double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::this_thread::sleep_until(deadline - std::chrono::microseconds(200));
  while (Clock::now() < deadline) std::this_thread::yield();
}

// Identity whose forward sleeps t and whose backward sleeps 2t.
struct SleepFn : torch::autograd::Function<SleepFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double t) {
    ctx->saved_data["t"] = t;
    ctx->save_for_backward({w});
    nap(t);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    nap(2 * ctx->saved_data["t"].toDouble());
    const auto w = ctx->get_saved_variables()[0];
    return {grads[0], at::zeros_like(w), at::Tensor()};
  }
};

// A layer with one parameter, so its backward runs even where its input
// needs no grad (stage 0).
struct SleepLayerImpl : torch::nn::Module {
  explicit SleepLayerImpl(double seconds) : t(seconds) {
    w = register_parameter("w", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return SleepFn::apply(x, w, t); }
  double t;
  torch::Tensor w;
};
TORCH_MODULE(SleepLayer);

// Identity of x whose forward sleeps t and whose backward sleeps t for x's
// grad and t for w's, each only when the running backward needs it: C++'s
// needs_input_grad asks the running graph task, so zero-bubble's I pass
// (toward the input only) pays t, its W pass t, a whole backward 2t.
struct SplitSleepFn : torch::autograd::Function<SplitSleepFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double t) {
    ctx->saved_data["t"] = t;
    ctx->save_for_backward({w});
    nap(t);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double t = ctx->saved_data["t"].toDouble();
    const bool input = ctx->needs_input_grad(0);
    const bool weight = ctx->needs_input_grad(1);
    // One nap for both halves: two would pay the wake-up twice.
    nap((input ? t : 0) + (weight ? t : 0));
    const auto w = ctx->get_saved_variables()[0];
    return {input ? grads[0] : at::Tensor(), weight ? at::zeros_like(w) : at::Tensor(),
            at::Tensor()};
  }
};

struct SplitSleepLayerImpl : torch::nn::Module {
  explicit SplitSleepLayerImpl(double seconds) : t(seconds) {
    w = register_parameter("w", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return SplitSleepFn::apply(x, w, t); }
  double t;
  torch::Tensor w;
};
TORCH_MODULE(SplitSleepLayer);

struct ScheduleCase {
  const char* name;
  gpipe::Schedule schedule;
  gpipe::detail::PlanKind kind;
  int64_t v;  // virtual stages per device
};

const std::vector<ScheduleCase> kScheduleCases = {
    {"gpipe", gpipe::Schedule::GPipe, gpipe::detail::PlanKind::GPipe, 1},
    {"1f1b", gpipe::Schedule::OneFOneB, gpipe::detail::PlanKind::OneFOneB, 1},
    {"interleaved_1f1b", gpipe::Schedule::Interleaved1F1B,
     gpipe::detail::PlanKind::Interleaved1F1B, 2},
    {"zb_h1", gpipe::Schedule::ZBH1, gpipe::detail::PlanKind::ZBH1, 1},
    {"zb_v", gpipe::Schedule::ZBV, gpipe::detail::PlanKind::ZBV, 2},
};

// The schedule's closed-form efficiency against perfect parallelism, for a
// backward of 2t (split into I = t, W = t).
double bound_of(const ScheduleCase& c, int64_t k, int64_t m) {
  const auto K = static_cast<double>(k), M = static_cast<double>(m);
  switch (c.kind) {
    case gpipe::detail::PlanKind::Interleaved1F1B:
      return M / (M + (K - 1) / static_cast<double>(c.v));
    case gpipe::detail::PlanKind::ZBH1:
      return 3 * M / (3 * M + K - 1);
    case gpipe::detail::PlanKind::ZBV:  // no closed form: its plan, simulated
      return 3 * M / gpipe::detail::simulate(gpipe::detail::zb_v_plan(k, m), {0.5, 1, 0.5, 0.5})
                         .makespan;
    default:
      return M / (M + K - 1);
  }
}

// A Pipe of K*v split-sleep stages (forward t/v each) on K CPU "devices".
gpipe::Pipe schedule_pipe(const ScheduleCase& c, int64_t k, int64_t m, double t) {
  const int64_t stages = k * c.v;
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < stages; ++i) seq->push_back(SplitSleepLayer(t / static_cast<double>(c.v)));
  return gpipe::Pipe(seq, gpipe::PipeOptions()
                              .balance(std::vector<int64_t>(static_cast<size_t>(stages), 1))
                              .devices(std::vector<c10::Device>(static_cast<size_t>(k), torch::kCPU))
                              .chunks(m)
                              .checkpoint(gpipe::Checkpoint::Never)
                              .schedule(c.schedule)
                              .virtual_stages(c.v));
}

torch::nn::Sequential sleepers(int64_t layers, double t) {
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < layers; ++i) seq->push_back(SleepLayer(t));
  return seq;
}

// Median seconds of one forward + backward of a mini-batch of M rows.
double step_time(const std::vector<int64_t>& balance, int64_t m, double t, int warmup, int reps) {
  int64_t layers = 0;
  for (auto b : balance) layers += b;
  gpipe::Pipe pipe(sleepers(layers, t),
                   gpipe::PipeOptions()
                       .balance(balance)
                       .devices(std::vector<c10::Device>(balance.size(), torch::kCPU))
                       .chunks(m)
                       .checkpoint(gpipe::Checkpoint::Never));
  const auto x = torch::zeros({m, 1});
  return bench::median(bench::time_runs([&] { pipe->forward(x).sum().backward(); }, warmup, reps));
}

// Median seconds of the same sleep layer on M micro-batches of one row in a
// plain loop on this thread (forward each, then one backward), no gpipe.
double plain_loop_time(int64_t m, double t, int warmup, int reps) {
  auto seq = sleepers(1, t);
  const auto pieces = torch::zeros({m, 1}).chunk(m, 0);
  auto step = [&] {
    std::vector<torch::Tensor> ys;
    ys.reserve(pieces.size());
    for (const auto& p : pieces) ys.push_back(seq->forward(p));
    torch::cat(ys, 0).sum().backward();
  };
  return bench::median(bench::time_runs(step, warmup, reps));
}

// Mean seconds per task kind (forward, backward, input grad, weight grad)
// in one traced train_step of `pipe`: the costs its cells really had.
gpipe::detail::Costs traced_costs(gpipe::Pipe& pipe, const torch::Tensor& x,
                                  const torch::Tensor& target,
                                  const gpipe::PipeImpl::LossFn& loss_fn) {
  pipe->clear_trace();
  pipe->set_tracing(true);
  pipe->train_step(x, target, loss_fn);
  pipe->set_tracing(false);
  double sum[4] = {0, 0, 0, 0};
  int count[4] = {0, 0, 0, 0};
  for (const auto& e : pipe->trace().events) {
    int k = -1;
    if (e.phase == gpipe::TracePhase::Forward) k = 0;
    if (e.phase == gpipe::TracePhase::Backward) k = 1;
    if (e.phase == gpipe::TracePhase::InputGrad) k = 2;
    if (e.phase == gpipe::TracePhase::WeightGrad) k = 3;
    if (k < 0) continue;
    sum[k] += (e.end_us - e.start_us) * 1e-6;
    ++count[k];
  }
  pipe->clear_trace();
  auto mean = [&](int k) { return count[k] > 0 ? sum[k] / count[k] : 0.0; };
  return {mean(0), mean(1), mean(2), mean(3)};
}

// Mean seconds one nap(seconds) really takes on this machine.
double measured_nap(double seconds, int n) {
  const auto start = bench::Clock::now();
  for (int i = 0; i < n; ++i) nap(seconds);
  return bench::seconds_since(start) / n;
}

// The same plan run by bare threads, without torch or the engine: worker w
// naps each task of its list in order for the task's cost in the naps'
// unit (forward = 1 unit of t/v, I = W = 1, B = 2), after waiting for the
// task's inputs as the engine's receivers do (spin 50 us, then park;
// transport.cpp). Its step time is what these naps, one thread per worker
// on this machine's cores, and plain hand-offs cost any engine running the
// plan: "bare vs perfect" is the most the engine could show here.
double bare_plan_time(const gpipe::detail::Plan& plan, double unit) {
  using gpipe::detail::Op;
  const auto stages = plan.stages;
  const auto m = plan.microbatches;
  const auto cell = [m](int64_t stage, int64_t mb) { return static_cast<size_t>(stage * m + mb); };
  // forwarded[s, i]: F(s, i) is done; graded[s, i]: B(s, i) or I(s, i) is.
  std::vector<std::atomic<bool>> forwarded(static_cast<size_t>(stages * m));
  std::vector<std::atomic<bool>> graded(static_cast<size_t>(stages * m));
  struct Box {
    std::mutex mutex;
    std::condition_variable arrived;
    std::atomic<int> parked{0};
  };
  std::vector<Box> boxes(static_cast<size_t>(plan.workers));
  auto wait = [&](int64_t worker, const std::atomic<bool>& flag) {
    if (flag.load()) return;
    const auto until = bench::Clock::now() + std::chrono::microseconds(50);
    while (!flag.load() && bench::Clock::now() < until) std::this_thread::yield();
    if (flag.load()) return;
    auto& box = boxes[static_cast<size_t>(worker)];
    std::unique_lock<std::mutex> hold(box.mutex);
    box.parked.fetch_add(1);
    box.arrived.wait(hold, [&] { return flag.load(); });
    box.parked.fetch_sub(1);
  };
  auto post = [&](int64_t worker, std::atomic<bool>& flag) {
    flag.store(true);
    auto& box = boxes[static_cast<size_t>(worker)];
    if (box.parked.load() > 0) {
      { std::lock_guard<std::mutex> hold(box.mutex); }
      box.arrived.notify_all();
    }
  };
  const auto start = bench::Clock::now();
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < plan.workers; ++w) {
    threads.emplace_back([&, w] {
      for (const auto& task : plan.lists[static_cast<size_t>(w)]) {
        const auto s = task.stage, i = task.microbatch;
        if (task.op == Op::F) {
          if (s > 0) wait(w, forwarded[cell(s - 1, i)]);
          nap(unit);
          if (s + 1 < stages) post(plan.worker_of(s + 1), forwarded[cell(s, i)]);
          else forwarded[cell(s, i)].store(true);
        } else if (task.op == Op::W) {
          nap(unit);  // after I(s, i), earlier in this worker's list
        } else {
          wait(w, forwarded[cell(s, i)]);
          if (s + 1 < stages) wait(w, graded[cell(s + 1, i)]);
          nap(task.op == Op::B ? 2 * unit : unit);
          if (s > 0) post(plan.worker_of(s - 1), graded[cell(s, i)]);
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return bench::seconds_since(start);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::quick(argc, argv);
  bool schedules_only = false;
  int64_t devices = 0;  // --devices K: the schedules' K (default: the largest K below)
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    schedules_only |= arg == "--schedules";
    if (arg != "--devices") continue;
    char* end = nullptr;
    const char* count = i + 1 < argc ? argv[++i] : "";
    devices = std::strtoll(count, &end, 10);
    if (*count == '\0' || *end != '\0' || devices < 1) {
      std::fprintf(stderr, "bench_sim: --devices '%s': give a count of 1 or more, e.g. "
                   "--devices 2\n", count);
      return 2;
    }
  }
  // Timer slack is per thread and inherited at thread creation: set it
  // before any Pipe (and its workers) exists.
  const bool slack_set = prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL) == 0;
  at::set_num_threads(1);

  const double t = quick ? 0.001 : 0.002;
  const std::vector<int64_t> ks =
      quick ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 2, 4, 8};
  const std::vector<int64_t> ms =
      quick ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 4, 8, 16, 32};
  const int warmup = 1;
  const int reps = quick ? 2 : 7;
  const int serial_reps = quick ? 1 : 3;
  const int64_t per_stage = 1;

  const double fwd = measured_nap(t, quick ? 20 : 100);
  const double bwd = measured_nap(2 * t, quick ? 20 : 100);
  std::printf(
      "sim: sleep layers, t = %.1f ms (forward t, backward 2t), %lld layer per stage, "
      "checkpoint=never, median of %d steps after %d warm-up; %u hardware threads\n",
      t * 1e3, static_cast<long long>(per_stage), reps, warmup,
      std::thread::hardware_concurrency());
  std::printf("sim: timer slack 1 ns %s; measured sleep(t) = %.3f ms, sleep(2t) = %.3f ms\n",
              slack_set ? "set" : "NOT set (prctl failed)", fwd * 1e3, bwd * 1e3);
  std::printf(
      "sim: eff(real cells) uses the same layer's real cost per micro-batch, from a "
      "plain loop on one thread (median of %d)\n\n",
      serial_reps);

  // Per micro-batch (forward + backward) cost of one sleep layer, for real.
  std::vector<double> cell;
  for (int64_t m : schedules_only ? std::vector<int64_t>{} : ms) {
    cell.push_back(plain_loop_time(m, t, warmup, serial_reps) / static_cast<double>(m));
  }

  bench::Table table({"K", "M", "measured ms", "ideal ms", "efficiency", "eff(real cells)",
                      "K=1 same model ms", "speedup", "ideal speedup"});
  struct Row {
    int64_t k, m;
    double efficiency, efficiency_real, speedup;
  };
  std::vector<Row> rows;
  for (int64_t k : schedules_only ? std::vector<int64_t>{} : ks) {
    for (size_t mi = 0; mi < ms.size(); ++mi) {
      const int64_t m = ms[mi];
      const double measured =
          step_time(std::vector<int64_t>(static_cast<size_t>(k), per_stage), m, t, warmup, reps);
      // The same K-layer model as one stage: everything in series.
      const double serial =
          k == 1 ? measured : step_time({k * per_stage}, m, t, warmup, serial_reps);
      const double steps = static_cast<double>(m + k - 1) * static_cast<double>(per_stage);
      const double ideal = steps * 3 * t;
      const double ideal_real = steps * cell[mi];
      const double efficiency = ideal / measured;
      const double speedup = serial / measured;
      rows.push_back({k, m, efficiency, ideal_real / measured, speedup});
      table.add({std::to_string(k), std::to_string(m), bench::fixed(measured * 1e3, 1),
                 bench::fixed(ideal * 1e3, 1), bench::fixed(efficiency, 3),
                 bench::fixed(ideal_real / measured, 3), bench::fixed(serial * 1e3, 1),
                 bench::fixed(speedup, 2),
                 bench::fixed(static_cast<double>(k * m) / static_cast<double>(m + k - 1), 2)});
    }
  }
  if (!schedules_only) {
    table.print();
    std::printf("\n");
  }

  // ---- schedules: train_step at the largest K and M -------------------------------------
  const int64_t sk = devices > 0 ? devices : ks.back();
  const int64_t sm = ms.back();
  const int sched_reps = quick ? 2 : 9;
  std::vector<gpipe::Pipe> pipes;
  for (const auto& c : kScheduleCases) pipes.push_back(schedule_pipe(c, sk, sm, t));
  const auto sx = torch::zeros({sm, 1}).requires_grad_(true);
  const auto target = torch::zeros({sm, 1});
  const gpipe::PipeImpl::LossFn loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return (out - y).sum();
  };
  std::vector<gpipe::detail::Plan> plans;
  for (const auto& c : kScheduleCases) plans.push_back(gpipe::detail::make_plan(c.kind, sk, c.v, sm));
  std::vector<std::vector<double>> sched_times(kScheduleCases.size());
  std::vector<std::vector<double>> bare_times(kScheduleCases.size());
  for (int r = 0; r < warmup + sched_reps; ++r) {
    for (size_t i = 0; i < pipes.size(); ++i) {
      const double s =
          bench::time_runs([&] { pipes[i]->train_step(sx, target, loss_fn); }, 0, 1).front();
      const double bare = bare_plan_time(plans[i], t / static_cast<double>(kScheduleCases[i].v));
      if (r >= warmup) {
        sched_times[i].push_back(s);
        bare_times[i].push_back(bare);
      }
    }
  }
  std::printf(
      "sim: schedules, train_step, K=%lld devices, M=%lld, split sleep layers (forward t, "
      "backward 2t = input half t + weight half t; interleaved: 2K stages of half that), "
      "median of %d steps after %d warm-up, the schedules' steps interleaved; perfect = M x 3t "
      "= %.1f ms per device\n\n",
      static_cast<long long>(sk), static_cast<long long>(sm), sched_reps, warmup,
      static_cast<double>(sm) * 3 * t * 1e3);
  bench::Table sched_table({"schedule", "v", "measured ms", "bound ms", "simulate ms",
                            "bound/perfect", "simulate/perfect", "eff vs perfect",
                            "eff vs bound", "eff vs traced cells", "bare ms", "bare vs perfect",
                            "eff vs bare", "sim bubble", "peak in flight"});
  struct SchedRow {
    std::string name;
    double efficiency, vs_perfect, simulated, vs_traced_cells, bare_vs_perfect;
  };
  std::vector<SchedRow> sched_rows;
  const double perfect = static_cast<double>(sm) * 3 * t;
  for (size_t i = 0; i < kScheduleCases.size(); ++i) {
    const auto& c = kScheduleCases[i];
    const double measured = bench::median(sched_times[i]);
    const double bound = bound_of(c, sk, sm);
    const double v = static_cast<double>(c.v);
    const auto& plan = plans[i];
    const auto simulation = gpipe::detail::simulate(plan, {1 / v, 2 / v, 1 / v, 1 / v});
    const double simulated = static_cast<double>(sm) * 3 / simulation.makespan;
    int64_t peak = 0;
    for (auto p : simulation.peak_in_flight) peak = std::max(peak, p);
    // The plan again, with each kind of task costing what its cells took in
    // one traced step of this Pipe (naps on a busy VM run long): what the
    // schedule and the engine lose, apart from the machine's timers.
    const double real_makespan =
        gpipe::detail::simulate(plan, traced_costs(pipes[i], sx, target, loss_fn)).makespan;
    const double vs_perfect = perfect / measured;
    const double bare = bench::median(bare_times[i]);
    sched_rows.push_back({c.name, vs_perfect / bound, vs_perfect, simulated,
                          real_makespan / measured, perfect / bare});
    sched_table.add({c.name, std::to_string(c.v), bench::fixed(measured * 1e3, 1),
                     bench::fixed(perfect / bound * 1e3, 1),
                     bench::fixed(simulation.makespan * t * 1e3, 1), bench::fixed(bound, 3),
                     bench::fixed(simulated, 3), bench::fixed(vs_perfect, 3),
                     bench::fixed(vs_perfect / bound, 3),
                     bench::fixed(real_makespan / measured, 3), bench::fixed(bare * 1e3, 1),
                     bench::fixed(perfect / bare, 3), bench::fixed(bare / measured, 3),
                     bench::fixed(simulation.bubble, 3), std::to_string(peak)});
  }
  sched_table.print();
  std::printf("\n");

  for (const auto& r : rows) {
    std::printf(
        "BENCH sim K=%lld M=%lld efficiency=%.3f speedup=%.2f efficiency_vs_real_cells=%.3f\n",
        static_cast<long long>(r.k), static_cast<long long>(r.m), r.efficiency, r.speedup,
        r.efficiency_real);
  }
  for (const auto& r : sched_rows) {
    std::printf(
        "BENCH sim schedule=%s K=%lld M=%lld efficiency=%.3f efficiency_vs_perfect=%.3f "
        "simulated_vs_perfect=%.3f efficiency_vs_traced_cells=%.3f bare_vs_perfect=%.3f "
        "efficiency_vs_bare=%.3f\n",
        r.name.c_str(), static_cast<long long>(sk), static_cast<long long>(sm), r.efficiency,
        r.vs_perfect, r.simulated, r.vs_traced_cells, r.bare_vs_perfect,
        r.vs_perfect / r.bare_vs_perfect);
  }
  // ZB-V's plan against 1F1B's memory: 2K stages of half the work, so its pairs in flight
  // count half a stage each.
  {
    const auto plan = gpipe::detail::zb_v_plan(sk, sm);
    const auto simulation = gpipe::detail::simulate(plan, {0.5, 1, 0.5, 0.5});
    const auto one_f_one_b = gpipe::detail::simulate(gpipe::detail::one_f_one_b_plan(sk, sm));
    const auto peak = *std::max_element(simulation.peak_in_flight.begin(),
                                        simulation.peak_in_flight.end());
    const auto baseline = *std::max_element(one_f_one_b.peak_in_flight.begin(),
                                            one_f_one_b.peak_in_flight.end());
    std::printf(
        "BENCH sim plan=zb_v K=%lld M=%lld simulated_vs_perfect=%.3f peak_stages_in_flight=%.1f "
        "one_f_one_b_peak_stages=%lld\n",
        static_cast<long long>(sk), static_cast<long long>(sm),
        static_cast<double>(sm) * 3 / simulation.makespan, static_cast<double>(peak) / 2,
        static_cast<long long>(baseline));
  }
  return 0;
}
