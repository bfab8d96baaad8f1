// overhead.cpp — the engine's cost per cell: tiny layers where the schedule is all there is to time.
//
//   bench_overhead [--quick]
//   bench_overhead --profile CONFIG [STEPS]   only CONFIG (pipe, plain, loop, serial, traced)
//                                             for STEPS steps (default 2000), no table: for
//                                             `perf record` (docs/benchmarks.md, overhead)
//
// 8 layers Linear(16, 16), batch 64, K = 4 stages of 2 layers, M = 32
// micro-batches of 2 rows, CPU, one intra-op thread (at::set_num_threads(1),
// which every thread picks up on its first parallel op). checkpoint=never,
// so a step runs K*M*2 = 256 cells (forward and backward of each stage and
// micro-batch).
//
//   us_per_cell = (pipe step - plain step) / cells
//
// "plain" is the baseline: the same layers as a torch::nn::Sequential
// on the whole batch on one thread. Most of that difference is not the
// scheduler but eager PyTorch running 32 small micro-batches instead of one
// batch (32x the ops and autograd nodes), so two more references split it:
//   * 32-mb loop: the Sequential on the same 32 micro-batches in a loop, one
//     backward; "us_per_cell_vs_microbatched" charges the engine only with
//     what is left over that.
//   * cells in series: what gpipe does per cell, on one thread, no workers:
//     each stage's forward on a detached input behind an identity autograd
//     node (gpipe's stage boundary), and one torch::autograd::backward per
//     cell, in the GPipe backward order. Pipe minus this is the cost of the
//     workers: hand-offs, wake-ups, thread-local state, cross-thread frees.
//   * tracing on: a second, identical Pipe with tracing on (its trace
//     cleared at the start of each step): what recording every cell costs.
//     Off, tracing is one relaxed atomic load per cell, so this bounds it.
// Steps of all five are interleaved, so noise hits them alike; "cores used"
// is process CPU time over wall time while each one ran.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include "bench.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::nn::Sequential tiny(int64_t layers) {
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < layers; ++i) seq->push_back(torch::nn::Linear(16, 16));
  return seq;
}

// The identity node gpipe puts between a stage's input leaf and its layers.
struct Boundary : torch::autograd::Function<Boundary> {
  static variable_list forward(AutogradContext* /*ctx*/, at::TensorList xs) {
    variable_list out;
    for (const auto& x : xs) out.push_back(x.detach());
    return out;
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return grads; }
};

// gpipe's cells run one after another on this thread: per-cell graphs, one
// backward call per cell, no worker threads.
class SerialCells {
 public:
  SerialCells(int64_t stages, int64_t per_stage, int64_t m)
      : k_(stages), m_(m), outs_(stages), leaves_(stages) {
    for (int64_t j = 0; j < stages; ++j) stages_.push_back(tiny(per_stage));
  }

  void step(const std::vector<torch::Tensor>& pieces) {
    std::vector<torch::Tensor> ys;
    for (auto& v : outs_) v.assign(static_cast<size_t>(m_), torch::Tensor());
    for (auto& v : leaves_) v.assign(static_cast<size_t>(m_), torch::Tensor());
    for (int64_t i = 0; i < m_; ++i) {
      torch::Tensor h = pieces[static_cast<size_t>(i)];
      for (int64_t j = 0; j < k_; ++j) {
        torch::Tensor in = h;
        if (j > 0) {
          auto leaf = h.detach().requires_grad_(true);
          in = Boundary::apply(at::TensorList(leaf))[0];
          leaves_[j][i] = leaf;
        }
        outs_[j][i] = stages_[static_cast<size_t>(j)]->forward(in);
        h = outs_[j][i].detach().requires_grad_(true);
      }
      ys.push_back(h);
    }
    const auto grads_all = torch::ones_like(torch::cat(ys, 0)).chunk(m_, 0);
    std::vector<torch::Tensor> grads(grads_all.begin(), grads_all.end());
    for (int64_t j = k_ - 1; j >= 0; --j) {
      for (int64_t i = m_ - 1; i >= 0; --i) {
        torch::autograd::backward({outs_[j][i]}, {grads[static_cast<size_t>(i)]});
        if (j > 0) grads[static_cast<size_t>(i)] = leaves_[j][i].grad();
      }
    }
  }

 private:
  int64_t k_, m_;
  std::vector<torch::nn::Sequential> stages_;
  std::vector<std::vector<torch::Tensor>> outs_, leaves_;
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::quick(argc, argv);
  std::string profile;
  int profile_steps = 2000;
  for (int a = 1; a < argc; ++a) {
    if (std::string(argv[a]) != "--profile") continue;
    if (a + 1 >= argc) {
      std::fprintf(stderr, "bench_overhead: --profile needs a configuration: pipe, plain, loop, "
                           "serial or traced\n");
      return 2;
    }
    profile = argv[a + 1];
    if (a + 2 < argc) profile_steps = std::atoi(argv[a + 2]);
  }
  at::set_num_threads(1);
  torch::manual_seed(0);

  const int64_t k = 4;
  const int64_t per_stage = 2;
  const int64_t m = 32;
  const int64_t batch = 64;
  const int warmup = quick ? 5 : 50;
  const int reps = quick ? 20 : 400;
  const int64_t cells = k * m * 2;

  auto plain = tiny(k * per_stage);
  auto plain_mb = tiny(k * per_stage);
  SerialCells serial(k, per_stage, m);
  gpipe::Pipe pipe(tiny(k * per_stage),
                   gpipe::PipeOptions()
                       .balance(std::vector<int64_t>(static_cast<size_t>(k), per_stage))
                       .devices(std::vector<c10::Device>(static_cast<size_t>(k), torch::kCPU))
                       .chunks(m)
                       .checkpoint(gpipe::Checkpoint::Never));
  gpipe::Pipe traced(tiny(k * per_stage),
                     gpipe::PipeOptions()
                         .balance(std::vector<int64_t>(static_cast<size_t>(k), per_stage))
                         .devices(std::vector<c10::Device>(static_cast<size_t>(k), torch::kCPU))
                         .chunks(m)
                         .checkpoint(gpipe::Checkpoint::Never)
                         .trace(true));
  const auto x = torch::randn({batch, 16});
  const auto pieces = x.chunk(m, 0);

  struct Config {
    std::string name;
    std::function<void()> step;
    bench::Timing timing;
  };
  std::vector<Config> configs;
  configs.push_back({"gpipe Pipe (K=4, M=32)", [&] { pipe->forward(x).sum().backward(); }, {}});
  configs.push_back(
      {"plain Sequential, batch 64", [&] { plain->forward(x).sum().backward(); }, {}});
  configs.push_back({"plain Sequential, 32-mb loop",
                     [&] {
                       std::vector<torch::Tensor> ys;
                       ys.reserve(pieces.size());
                       for (const auto& p : pieces) ys.push_back(plain_mb->forward(p));
                       torch::cat(ys, 0).sum().backward();
                     },
                     {}});
  configs.push_back({"gpipe's cells in series, 1 thread", [&] { serial.step(pieces); }, {}});
  configs.push_back({"gpipe Pipe, tracing on",
                     [&] {
                       traced->clear_trace();
                       traced->forward(x).sum().backward();
                     },
                     {}});

  if (!profile.empty()) {
    const std::vector<std::string> keys = {"pipe", "plain", "loop", "serial", "traced"};
    const auto it = std::find(keys.begin(), keys.end(), profile);
    if (it == keys.end() || profile_steps < 1) {
      std::fprintf(stderr, "bench_overhead: --profile %s %d: choose pipe, plain, loop, serial "
                           "or traced, and a positive step count\n", profile.c_str(), profile_steps);
      return 2;
    }
    auto& c = configs[static_cast<size_t>(it - keys.begin())];
    for (int i = 0; i < warmup; ++i) c.step();
    for (int i = 0; i < profile_steps; ++i) c.timing.run(c.step);
    std::printf("%s: median step %.1f us over %d steps, %.2f cores\n", c.name.c_str(),
                bench::median(c.timing.wall) * 1e6, profile_steps, c.timing.cores());
    return 0;
  }
  for (int i = 0; i < warmup; ++i) {
    for (auto& c : configs) c.step();
  }
  for (int i = 0; i < reps; ++i) {
    for (auto& c : configs) c.timing.run(c.step);
  }
  std::vector<double> med;
  for (const auto& c : configs) med.push_back(bench::median(c.timing.wall));
  auto per_cell = [&](double s) { return s / static_cast<double>(cells) * 1e6; };
  const double us_per_cell = per_cell(med[0] - med[1]);
  const double us_per_cell_mb = per_cell(med[0] - med[2]);

  std::printf(
      "overhead: %lld x Linear(16, 16), batch %lld, K=%lld stages x %lld layers, M=%lld, "
      "checkpoint=never, 1 intra-op thread, %lld cells per step, median of %d steps "
      "(interleaved) after %d warm-up\n\n",
      static_cast<long long>(k * per_stage), static_cast<long long>(batch),
      static_cast<long long>(k), static_cast<long long>(per_stage), static_cast<long long>(m),
      static_cast<long long>(cells), reps, warmup);
  bench::Table table(
      {"configuration", "step us", "cores used", "CPU us / step", "(pipe - this) / cells, us"});
  for (size_t c = 0; c < configs.size(); ++c) {
    const double cpu_per_step =
        configs[c].timing.cpu / static_cast<double>(configs[c].timing.wall.size());
    table.add({configs[c].name, bench::fixed(med[c] * 1e6, 1),
               bench::fixed(configs[c].timing.cores(), 2), bench::fixed(cpu_per_step * 1e6, 1),
               c == 0 ? "" : bench::fixed(per_cell(med[0] - med[c]), 2)});
  }
  table.print();
  std::printf(
      "\nper cell: micro-batching itself (32-mb loop - batch 64) %.2f us; gpipe's cell "
      "structure (cells in series - 32-mb loop) %.2f us; the workers (pipe - cells in "
      "series) %.2f us wall, %.2f us CPU\n\n",
      per_cell(med[2] - med[1]), per_cell(med[3] - med[2]), per_cell(med[0] - med[3]),
      per_cell(configs[0].timing.cpu / static_cast<double>(reps) -
               configs[3].timing.cpu / static_cast<double>(reps)));
  std::printf("tracing on costs %.2f us per cell (traced Pipe - Pipe)\n\n",
              per_cell(med[4] - med[0]));
  std::printf(
      "BENCH overhead us_per_cell=%.2f us_per_cell_vs_microbatched=%.2f "
      "tracing_on_us_per_cell=%.2f\n",
      us_per_cell, us_per_cell_mb, per_cell(med[4] - med[0]));
  return 0;
}
