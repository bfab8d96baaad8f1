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
//   pipe      gpipe Pipe, 2 CPU stages, intra_op_threads(1): one thread per stage
//   plain x1  the Sequential on the whole batch, at::set_num_threads(1)
//   plain x2  the Sequential on the whole batch, at::set_num_threads(2)
//   mb loop   the Sequential on the same 16 micro-batches in a loop, 1 thread:
//             what micro-batching alone costs or saves
// and, as a user runs them, with default thread settings on both sides:
//   plain default  the Sequential with torch's default thread count (N)
//   pipe default   the Pipe with PipeOptions' default intra_op_threads (the
//                  N threads split between the 2 stages), checkpoint=never
//                  as above; and with the default checkpoint (except_last)
//   pipe -1        the Pipe with intra_op_threads(-1): torch's count in every
//                  stage, as before the split (K x N threads on N cores)
//
// and the whole step inside the pipeline (`train_step`, loss = MSE against
// zeros on the last stage), 2 stages x 1 thread, checkpoint=never:
//   train_step gpipe  Schedule::GPipe: every forward, then every backward
//   train_step 1f1b   Schedule::OneFOneB: forwards and backwards in turn
// (`BENCH real schedule=1f1b over_gpipe=` gpipe's time / 1f1b's).
//
// A Pipe fixes its workers' intra-op counts when it is built, from its
// options and the building thread's count; at::set_num_threads on the main
// thread between steps changes only the main thread's (and the plain
// model's) count. What each stage really ran with is checked two ways: a
// probe layer records at::get_num_threads() inside each worker, and the
// process CPU time over wall time gives the cores in use.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include "bench.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
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

// A 2-stage Pipe over a copy of `plain`'s pairs with a probe at the head of
// each stage, built with `options` (balance and devices are set here).
struct ProbedPipe {
  Probe probe0, probe1;
  gpipe::Pipe pipe{nullptr};
};
ProbedPipe probed_pipe(const torch::nn::Sequential& plain, int64_t pairs, int64_t hidden,
                       gpipe::PipeOptions options) {
  ProbedPipe p;
  torch::nn::Sequential model;
  model->push_back(p.probe0);
  add_pairs(model, pairs, hidden);
  model->push_back(p.probe1);
  add_pairs(model, pairs, hidden);
  {
    torch::NoGradGuard no_grad;
    const auto from = plain->parameters();
    auto to = model->parameters();
    for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
  }
  const auto per_stage = 1 + 2 * pairs;
  p.pipe = gpipe::Pipe(model, options.balance({per_stage, per_stage})
                                  .devices({torch::kCPU, torch::kCPU}));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::quick(argc, argv);
  // Torch's default, before anything here changes it: what a user gets.
  const int default_threads = at::get_num_threads();
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

  // The plain model; each Pipe gets a copy of its layers (and weights)
  // with a probe at the head of each stage.
  torch::nn::Sequential plain;
  add_pairs(plain, 2 * pairs, hidden);
  auto one_each = probed_pipe(plain, pairs, hidden,
                              gpipe::PipeOptions()
                                  .chunks(m)
                                  .checkpoint(gpipe::Checkpoint::Never)
                                  .intra_op_threads(1));
  // Built as a user's program builds them: torch's default count on this
  // thread, PipeOptions' default intra_op_threads.
  at::set_num_threads(default_threads);
  auto by_default = probed_pipe(plain, pairs, hidden,
                                gpipe::PipeOptions().chunks(m).checkpoint(gpipe::Checkpoint::Never));
  auto all_default = probed_pipe(plain, pairs, hidden, gpipe::PipeOptions().chunks(m));
  auto unsplit = probed_pipe(
      plain, pairs, hidden,
      gpipe::PipeOptions().chunks(m).checkpoint(gpipe::Checkpoint::Never).intra_op_threads(-1));
  auto step_gpipe = probed_pipe(plain, pairs, hidden,
                                gpipe::PipeOptions()
                                    .chunks(m)
                                    .checkpoint(gpipe::Checkpoint::Never)
                                    .intra_op_threads(1)
                                    .schedule(gpipe::Schedule::GPipe));
  auto step_1f1b = probed_pipe(plain, pairs, hidden,
                               gpipe::PipeOptions()
                                   .chunks(m)
                                   .checkpoint(gpipe::Checkpoint::Never)
                                   .intra_op_threads(1)
                                   .schedule(gpipe::Schedule::OneFOneB));
  at::set_num_threads(1);
  const auto x = torch::randn({batch, hidden});
  const auto target = torch::zeros({batch, hidden});
  const gpipe::PipeImpl::LossFn mse = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y);
  };
  auto train_gpipe_step = [&] {
    at::set_num_threads(1);
    step_gpipe.pipe->train_step(x, target, mse);
  };
  auto train_1f1b_step = [&] {
    at::set_num_threads(1);
    step_1f1b.pipe->train_step(x, target, mse);
  };

  auto pipe_step = [&] {
    at::set_num_threads(1);
    one_each.pipe->forward(x).sum().backward();
  };
  auto pipe_default_step = [&] {
    at::set_num_threads(default_threads);
    by_default.pipe->forward(x).sum().backward();
  };
  auto pipe_all_default_step = [&] {
    at::set_num_threads(default_threads);
    all_default.pipe->forward(x).sum().backward();
  };
  auto pipe_unsplit_step = [&] {
    at::set_num_threads(default_threads);
    unsplit.pipe->forward(x).sum().backward();
  };
  auto plain_default_step = [&] {
    at::set_num_threads(default_threads);
    plain->forward(x).sum().backward();
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
    plain_default_step();
    pipe_default_step();
    pipe_all_default_step();
    pipe_unsplit_step();
    train_gpipe_step();
    train_1f1b_step();
  }
  bench::Timing t_pipe, t_plain1, t_plain2, t_loop, t_plain_default, t_pipe_default,
      t_pipe_all_default, t_pipe_unsplit, t_train_gpipe, t_train_1f1b;
  for (int i = 0; i < reps; ++i) {
    t_pipe.run(pipe_step);
    t_plain1.run(plain1_step);
    t_plain2.run(plain2_step);
    t_loop.run(loop_step);
    t_plain_default.run(plain_default_step);
    t_pipe_default.run(pipe_default_step);
    t_pipe_all_default.run(pipe_all_default_step);
    t_pipe_unsplit.run(pipe_unsplit_step);
    t_train_gpipe.run(train_gpipe_step);
    t_train_1f1b.run(train_1f1b_step);
  }
  at::set_num_threads(1);

  const double pipe_s = bench::median(t_pipe.wall);
  const double plain1_s = bench::median(t_plain1.wall);
  const double plain2_s = bench::median(t_plain2.wall);
  const double loop_s = bench::median(t_loop.wall);
  const double plain_default_s = bench::median(t_plain_default.wall);
  const double pipe_default_s = bench::median(t_pipe_default.wall);
  const double pipe_all_default_s = bench::median(t_pipe_all_default.wall);
  const double pipe_unsplit_s = bench::median(t_pipe_unsplit.wall);
  const double train_gpipe_s = bench::median(t_train_gpipe.wall);
  const double train_1f1b_s = bench::median(t_train_1f1b.wall);
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
      cell_s * 1e3, target_cell * 1e3, one_each.probe0->most.load(),
      one_each.probe1->most.load());
  std::printf(
      "real: torch's default intra-op threads here: %d; inside the default Pipe's workers: "
      "stage 0 = %d, stage 1 = %d; with intra_op_threads(-1): stage 0 = %d, stage 1 = %d\n\n",
      default_threads, by_default.probe0->most.load(), by_default.probe1->most.load(),
      unsplit.probe0->most.load(), unsplit.probe1->most.load());
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

  std::printf("default thread settings on both sides, as a user runs them:\n");
  bench::Table defaults({"configuration", "step ms", "samples/s", "cores used", "plain / this"});
  const auto threads = std::to_string(default_threads);
  defaults.add({"plain Sequential, torch's default (" + threads + " threads)",
                bench::fixed(plain_default_s * 1e3, 1), bench::fixed(samples / plain_default_s, 0),
                bench::fixed(t_plain_default.cores(), 2), ""});
  defaults.add({"gpipe Pipe, default intra_op_threads, checkpoint=never",
                bench::fixed(pipe_default_s * 1e3, 1), bench::fixed(samples / pipe_default_s, 0),
                bench::fixed(t_pipe_default.cores(), 2),
                bench::fixed(plain_default_s / pipe_default_s, 2)});
  defaults.add({"gpipe Pipe, all default (checkpoint=except_last)",
                bench::fixed(pipe_all_default_s * 1e3, 1),
                bench::fixed(samples / pipe_all_default_s, 0),
                bench::fixed(t_pipe_all_default.cores(), 2),
                bench::fixed(plain_default_s / pipe_all_default_s, 2)});
  defaults.add({"gpipe Pipe, intra_op_threads(-1) (unsplit), checkpoint=never",
                bench::fixed(pipe_unsplit_s * 1e3, 1), bench::fixed(samples / pipe_unsplit_s, 0),
                bench::fixed(t_pipe_unsplit.cores(), 2),
                bench::fixed(plain_default_s / pipe_unsplit_s, 2)});
  defaults.print();
  std::printf("\n");
  std::printf(
      "BENCH real speedup_vs_1thread=%.2f speedup_vs_2threads=%.2f default_threads_over_plain=%.2f "
      "all_defaults_over_plain=%.2f unsplit_over_plain=%.2f\n",
      plain1_s / pipe_s, plain2_s / pipe_s, plain_default_s / pipe_default_s,
      plain_default_s / pipe_all_default_s, plain_default_s / pipe_unsplit_s);

  std::printf(
      "\nthe step inside the pipeline (train_step, MSE loss on the last stage), 2 stages x 1 "
      "thread, checkpoint=never:\n");
  bench::Table steps({"configuration", "step ms", "samples/s", "cores used", "gpipe / this"});
  steps.add({"forward + backward (above)", bench::fixed(pipe_s * 1e3, 1),
             bench::fixed(samples / pipe_s, 0), bench::fixed(t_pipe.cores(), 2),
             bench::fixed(train_gpipe_s / pipe_s, 2)});
  steps.add({"train_step, schedule gpipe", bench::fixed(train_gpipe_s * 1e3, 1),
             bench::fixed(samples / train_gpipe_s, 0), bench::fixed(t_train_gpipe.cores(), 2),
             ""});
  steps.add({"train_step, schedule 1f1b", bench::fixed(train_1f1b_s * 1e3, 1),
             bench::fixed(samples / train_1f1b_s, 0), bench::fixed(t_train_1f1b.cores(), 2),
             bench::fixed(train_gpipe_s / train_1f1b_s, 2)});
  steps.print();
  std::printf("\nBENCH real schedule=1f1b over_gpipe=%.3f gpipe_step_ms=%.1f 1f1b_step_ms=%.1f\n",
              train_gpipe_s / train_1f1b_s, train_gpipe_s * 1e3, train_1f1b_s * 1e3);
  return 0;
}
