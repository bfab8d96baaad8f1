// real.cpp — real compute on this machine's cores: a 2-stage pipelined MLP against the plain one.
//
//   bench_real [--quick]
//
// An MLP of Linear(512, 512) + ReLU pairs, 2 stages, M = 16 micro-batches of
// 256 rows (batch 4096), forward + backward, checkpoint=never. The number of
// pairs per stage is calibrated at start so that one forward cell (one stage,
// one micro-batch) takes about 5 ms on one thread; its backward takes about
// twice that. Micro-batches of 256 rows keep the matrix products about as
// efficient as the whole batch's (on this machine, 1 thread: 64 rows x 512
// run at ~68 GFLOP/s, 256 rows at ~89, 1024 rows at ~84), so the comparison
// measures the pipeline, not smaller GEMMs.
//
// Compared, steps interleaved so noise hits all alike:
//   pipe      gpipe Pipe, 2 CPU stages, at::set_num_threads(1): one core per stage
//   plain x1  the Sequential on the whole batch, at::set_num_threads(1)
//   plain x2  the Sequential on the whole batch, at::set_num_threads(2)
//   mb loop   the Sequential on the same 16 micro-batches in a loop, 1 thread:
//             what micro-batching alone costs or saves
//
// at::set_num_threads sets a process-wide count that each thread (our
// workers included) adopts on its first parallel op, and MKL's global
// count. Switching between 1 and 2 on the main thread between steps is safe
// because the workers are idle then. What each stage really ran with is
// checked two ways: a probe layer records at::get_num_threads() inside each
// worker, and the process CPU time over wall time gives the cores in use.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include "bench.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

namespace {

// Identity that records the intra-op thread count of the thread running it.
struct ProbeImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    const int n = at::get_num_threads();
    int seen = most.load();
    while (n > seen && !most.compare_exchange_weak(seen, n)) {
    }
    return x;
  }
  std::atomic<int> most{0};
};
TORCH_MODULE(Probe);

void add_pairs(torch::nn::Sequential& seq, int64_t pairs, int64_t hidden) {
  for (int64_t i = 0; i < pairs; ++i) {
    seq->push_back(torch::nn::Linear(hidden, hidden));
    seq->push_back(torch::nn::ReLU());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::quick(argc, argv);
  at::set_num_threads(1);
  torch::manual_seed(0);

  const int64_t hidden = 512;
  const int64_t m = 16;
  const int64_t rows = quick ? 16 : 256;
  const int64_t batch = m * rows;
  const double target_cell = quick ? 0.001 : 0.005;
  const int warmup = quick ? 1 : 2;
  const int reps = quick ? 2 : 7;

  // Calibrate the pairs per stage: forward seconds of a stage of n pairs on
  // one micro-batch, one thread, first for n = 4, then for the n that
  // suggests (distinct weights per pair, as in the model: cache effects count).
  auto stage_forward = [&](int64_t n) {
    torch::nn::Sequential stage;
    add_pairs(stage, n, hidden);
    const auto mb = torch::randn({rows, hidden});
    torch::NoGradGuard no_grad;
    return bench::median(bench::time_runs([&] { stage->forward(mb); }, 3, quick ? 5 : 30));
  };
  auto pairs_for = [&](int64_t n, double seconds) {
    return std::clamp<int64_t>(std::llround(static_cast<double>(n) * target_cell / seconds), 1, 64);
  };
  const int64_t guess = pairs_for(4, stage_forward(4));
  const int64_t pairs = pairs_for(guess, stage_forward(guess));

  torch::nn::Sequential model;
  Probe probe0, probe1;
  model->push_back(probe0);
  add_pairs(model, pairs, hidden);
  model->push_back(probe1);
  add_pairs(model, pairs, hidden);
  // The plain model: the same layers without the probes, the same weights.
  torch::nn::Sequential plain;
  add_pairs(plain, 2 * pairs, hidden);
  {
    torch::NoGradGuard no_grad;
    const auto from = model->parameters();
    auto to = plain->parameters();
    for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
  }
  const auto per_stage = 1 + 2 * pairs;
  gpipe::Pipe pipe(model, gpipe::PipeOptions()
                              .balance({per_stage, per_stage})
                              .devices({torch::kCPU, torch::kCPU})
                              .chunks(m)
                              .checkpoint(gpipe::Checkpoint::Never));
  const auto x = torch::randn({batch, hidden});

  auto pipe_step = [&] {
    at::set_num_threads(1);
    pipe->forward(x).sum().backward();
  };
  auto plain1_step = [&] {
    at::set_num_threads(1);
    plain->forward(x).sum().backward();
  };
  auto plain2_step = [&] {
    at::set_num_threads(2);
    plain->forward(x).sum().backward();
  };
  const auto pieces = x.chunk(m, 0);
  auto loop_step = [&] {
    at::set_num_threads(1);
    std::vector<torch::Tensor> ys;
    ys.reserve(pieces.size());
    for (const auto& p : pieces) ys.push_back(plain->forward(p));
    torch::cat(ys, 0).sum().backward();
  };
  // One forward cell, timed alone: stage 0's layers on one micro-batch.
  double cell_s = 0;
  {
    at::set_num_threads(1);
    torch::nn::Sequential stage0;
    add_pairs(stage0, pairs, hidden);
    const auto mb = torch::randn({rows, hidden});
    torch::NoGradGuard no_grad;
    cell_s = bench::median(bench::time_runs([&] { stage0->forward(mb); }, 3, quick ? 5 : 30));
  }

  for (int i = 0; i < warmup; ++i) {
    pipe_step();
    plain1_step();
    plain2_step();
    loop_step();
  }
  bench::Timing t_pipe, t_plain1, t_plain2, t_loop;
  for (int i = 0; i < reps; ++i) {
    t_pipe.run(pipe_step);
    t_plain1.run(plain1_step);
    t_plain2.run(plain2_step);
    t_loop.run(loop_step);
  }
  at::set_num_threads(1);

  const double pipe_s = bench::median(t_pipe.wall);
  const double plain1_s = bench::median(t_plain1.wall);
  const double plain2_s = bench::median(t_plain2.wall);
  const double loop_s = bench::median(t_loop.wall);
  const double samples = static_cast<double>(batch);

  std::printf(
      "real: MLP of 2 x %lld (Linear(%lld, %lld) + ReLU), 2 stages, M=%lld micro-batches of "
      "%lld rows, forward + backward, checkpoint=never, median of %d steps (interleaved) "
      "after %d warm-up\n",
      static_cast<long long>(pairs), static_cast<long long>(hidden), static_cast<long long>(hidden),
      static_cast<long long>(m), static_cast<long long>(rows), reps, warmup);
  std::printf(
      "real: one forward cell = %.2f ms on 1 thread (target %.1f ms); intra-op threads "
      "seen inside the workers: stage 0 = %d, stage 1 = %d\n\n",
      cell_s * 1e3, target_cell * 1e3, probe0->most.load(), probe1->most.load());
  bench::Table table({"configuration", "step ms", "samples/s", "cores used", "pipe speedup"});
  table.add({"gpipe Pipe, 2 stages x 1 thread", bench::fixed(pipe_s * 1e3, 1),
             bench::fixed(samples / pipe_s, 0), bench::fixed(t_pipe.cores(), 2), ""});
  table.add({"plain Sequential, 1 thread", bench::fixed(plain1_s * 1e3, 1),
             bench::fixed(samples / plain1_s, 0), bench::fixed(t_plain1.cores(), 2),
             bench::fixed(plain1_s / pipe_s, 2)});
  table.add({"plain Sequential, 2 threads", bench::fixed(plain2_s * 1e3, 1),
             bench::fixed(samples / plain2_s, 0), bench::fixed(t_plain2.cores(), 2),
             bench::fixed(plain2_s / pipe_s, 2)});
  table.add({"plain Sequential, 16-mb loop, 1 thread", bench::fixed(loop_s * 1e3, 1),
             bench::fixed(samples / loop_s, 0), bench::fixed(t_loop.cores(), 2),
             bench::fixed(loop_s / pipe_s, 2)});
  table.print();
  std::printf("\n(ideal pipe speedup over 1 thread for K=2, M=%lld: %.2f)\n\n",
              static_cast<long long>(m), 2.0 * static_cast<double>(m) / static_cast<double>(m + 1));
  std::printf("BENCH real speedup_vs_1thread=%.2f speedup_vs_2threads=%.2f\n", plain1_s / pipe_s,
              plain2_s / pipe_s);
  return 0;
}
