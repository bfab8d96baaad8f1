// test_cuda.cpp — the Pipe contract on CUDA: one GPU, CPU+GPU mixed, checkpoint memory, streams, failures.
//
// Every case but the header check needs a CUDA device; without one it says
// "skipped: no CUDA device" (a Catch2 WARN, printed even when the case
// passes) and returns. tests/gpu/run.sh runs these on a lent GPU machine.
//
// Why these cases prove the CUDA rules of DESIGN.md:
//
//   * All stages on cuda:0: each stage computes on its own pool stream, so
//     every hand-over between stages is ordered only by events. The outputs
//     live on cuda:0, so the outer backward reaches PipeBackward on the
//     autograd engine's cuda:0 thread, the very thread every stage's own
//     backward needs: a wrong choice there hangs (the deadlock rule), which
//     `within_deadline` turns into a failure.
//   * CPU -> cuda:0 -> cuda:0 -> CPU: copies both ways, host waits on events,
//     and a backward that starts on the caller's thread.
//   * Many micro-batches with no synchronisation: a tensor freed on one
//     stream while another still reads it would be handed out again by the
//     caching allocator and show up as wrong numbers.
#include "models.h"
#include "streams.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

// gpipe's public headers (and torch/torch.h, which they sit beside) must not
// pull in CUDA: one libgpipe serves the CPU and the CUDA builds of torch.
// Checked here, before this file includes a CUDA header of its own.
#if defined(CUDART_VERSION) || defined(__CUDA_RUNTIME_H__) || defined(C10_CUDA_CHECK)
#error "a gpipe public header (or torch/torch.h) includes CUDA headers; keep them in csrc/"
#endif

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <cmath>
#include <cctype>
#include <chrono>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using Catch::Contains;
using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::deep_copy;
using gpipe_test::FaultPhase;
using gpipe_test::FaultPlan;
using gpipe_test::inplace_mlp;
using gpipe_test::kTolerance;
using gpipe_test::marked_input;
using gpipe_test::phase_word;
using gpipe_test::randn64;
using gpipe_test::within_deadline;
using gpipe_test::zero_grads;

namespace {

const torch::Device kCpu(torch::kCPU);
const torch::Device kGpu(torch::kCUDA, 0);

// First CUDA use (context, cuBLAS handles) takes seconds; a hang takes forever.
constexpr std::chrono::seconds kDeadline(120);

/// True when a CUDA device is present. Otherwise reports "skipped: no CUDA
/// device" for the running case (Catch2 v2 has no SKIP; a WARN is printed
/// whether or not the case passes) and the case should return.
bool cuda_or_skip() {
  if (torch::cuda::is_available()) return true;
  WARN("skipped: no CUDA device");
  return false;
}

// ---- comparing across devices -------------------------------------------------------------------

/// Largest elementwise |a - b|, both taken to the CPU first (a Pipe's output
/// may live elsewhere than its reference's). Infinity when only one is
/// defined or the shapes differ.
double max_abs_diff_anywhere(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return a.defined() == b.defined() ? 0.0 : std::numeric_limits<double>::infinity();
  }
  return gpipe_test::max_abs_diff(a.detach().to(kCpu), b.detach().to(kCpu));
}

/// Every parameter has a grad equal to the reference's (same names), each
/// compared on the CPU.
void check_param_grads_anywhere(const torch::nn::Module& pipe, const torch::nn::Module& ref) {
  const auto got = pipe.named_parameters();
  const auto want = ref.named_parameters();
  REQUIRE(gpipe_test::keys_of(got) == gpipe_test::keys_of(want));
  for (const auto& item : want) {
    INFO("parameter " << item.key());
    REQUIRE(item.value().grad().defined());
    REQUIRE(got[item.key()].grad().defined());
    CHECK(max_abs_diff_anywhere(got[item.key()].grad(), item.value().grad()) <= kTolerance);
  }
}

/// Every parameter of `module` lives on `device`.
void check_params_on(const torch::nn::Module& module, torch::Device device) {
  for (const auto& item : module.named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(item.value().device() == device);
  }
}

/// Forward and backward through `pipe` and through `ref` (its deep copy,
/// already on `ref_device`) with the same float64 input made on
/// `input_device`; compares the output, the input grad and every parameter
/// grad. The loss weights each output element differently.
void check_transparent(gpipe::Pipe& pipe, torch::nn::Sequential& ref, torch::Device input_device,
                       torch::Device ref_device, torch::Device output_device, int64_t rows) {
  const auto x = randn64({rows, 4});
  const auto weight = randn64({rows, 3});
  // Two distinct leaves (to() alone would return `x` itself on its own device).
  auto x_pipe = x.clone().to(input_device).requires_grad_(true);
  auto x_ref = x.clone().to(ref_device).requires_grad_(true);

  // The whole step under a deadline: a deadlock in backward fails the test.
  auto out_pipe = within_deadline(
      [&] {
        auto out = pipe->forward(x_pipe);
        (out * weight.to(out.device())).sum().backward();
        return out;
      },
      kDeadline);
  auto out_ref = ref->forward(x_ref);
  (out_ref * weight.to(ref_device)).sum().backward();

  CHECK(out_pipe.device() == output_device);
  REQUIRE(out_pipe.sizes() == out_ref.sizes());
  CHECK(max_abs_diff_anywhere(out_pipe, out_ref) <= kTolerance);
  REQUIRE(x_pipe.grad().defined());
  CHECK(x_pipe.grad().device() == input_device);
  CHECK(max_abs_diff_anywhere(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads_anywhere(*pipe, *ref);
}

// ---- CUDA caching allocator ---------------------------------------------------------------------

constexpr auto kAllStats = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

int64_t allocated_now() {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[kAllStats].current;
}

int64_t allocated_peak() {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[kAllStats].peak;
}

/// A deep float32 MLP whose activations dwarf its parameters: 32 x
/// (Linear(256, 256), ReLU). At 16384 rows one activation is 16 MiB, all
/// parameters together 8 MiB.
torch::nn::Sequential deep_mlp() {
  torch::manual_seed(6);
  torch::nn::Sequential model;
  for (int i = 0; i < 32; ++i) {
    model->push_back(torch::nn::Linear(256, 256));
    model->push_back(torch::nn::ReLU());
  }
  return model;
}

/// Bytes allocated on cuda:0 above what was allocated before, at the peak
/// of one training step (forward and backward) of a Pipe with `mode`.
int64_t step_peak_bytes(Checkpoint mode) {
  gpipe::Pipe pipe(deep_mlp(), PipeOptions()
                                   .balance({16, 16, 16, 16})
                                   .devices({kGpu, kGpu, kGpu, kGpu})
                                   .chunks(4)
                                   .checkpoint(mode));
  const auto x = torch::randn({16384, 256}, torch::TensorOptions().device(kGpu));
  auto step = [&] { within_deadline([&] { pipe->forward(x).mean().backward(); }, kDeadline); };
  // The first step creates what every later one reuses (cuBLAS workspaces,
  // one per stream and thread; the parameters' grads): not what we measure.
  step();
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const int64_t before = allocated_now();
  step();
  torch::cuda::synchronize();
  return allocated_peak() - before;
}

// ---- failures on CUDA ---------------------------------------------------------------------------

constexpr int64_t kFaultStages = 3;
constexpr int64_t kFaultMicrobatches = 4;

// Stage j is [MarkedLinear, Thrower(j)] on cuda:0 (see models.h).
torch::nn::Sequential faulty_model(const std::shared_ptr<FaultPlan>& plan) {
  return gpipe_test::faulty_model(plan, kFaultStages);
}

gpipe::Pipe faulty_pipe(torch::nn::Sequential model, Checkpoint mode) {
  return gpipe::Pipe(model, PipeOptions()
                                .balance({2, 2, 2})
                                .devices({kGpu, kGpu, kGpu})
                                .chunks(kFaultMicrobatches)
                                .checkpoint(mode));
}

// One training step on cuda:0; the exception it raised, if any.
std::exception_ptr faulty_step(gpipe::Pipe& pipe, const torch::Tensor& x) {
  return within_deadline(
      [&]() -> std::exception_ptr {
        try {
          pipe->forward(x).pow(2).sum().backward();
          return nullptr;
        } catch (...) {
          return std::current_exception();
        }
      },
      kDeadline);
}

}  // namespace

// ---- header hygiene (runs everywhere) -----------------------------------------------------------

TEST_CASE("cuda: gpipe's public headers include no CUDA header", "[cuda]") {
  // The #error above checks what the headers pull in; this checks what they
  // name, so a CUDA include behind an #if is caught too. Found from this
  // file's own path: tests/cpp/ -> include/gpipe/.
  namespace fs = std::filesystem;
  const fs::path include = fs::path(__FILE__).parent_path() / ".." / ".." / "include" / "gpipe";
  if (!fs::is_directory(include)) {
    WARN("skipped: the sources are not at " << include.string() << " (built elsewhere)");
    return;
  }
  int headers = 0;
  for (const auto& entry : fs::directory_iterator(include)) {
    if (entry.path().extension() != ".h") continue;
    ++headers;
    std::ifstream file(entry.path());
    std::string line;
    int number = 0;
    while (std::getline(file, line)) {
      ++number;
      if (line.find("#include") == std::string::npos) continue;
      std::string lower = line;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      INFO(entry.path().filename().string() << ":" << number << ": " << line);
      CHECK(lower.find("cuda") == std::string::npos);
      CHECK(lower.find("cudnn") == std::string::npos);
      CHECK(lower.find("nccl") == std::string::npos);
    }
  }
  CHECK(headers > 0);
}

// ---- one GPU: separate streams, events, the deadlock rule ---------------------------------------

TEST_CASE("cuda: each stage on one GPU gets its own compute and copy streams", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto a = gpipe::detail::make_lane(kGpu);
  const auto b = gpipe::detail::make_lane(kGpu);
  const auto default_stream = c10::Stream(c10::Stream::DEFAULT, kGpu);
  CHECK(a.device == kGpu);
  CHECK(a.compute != a.copy);
  CHECK(a.compute != b.compute);
  CHECK(a.compute != default_stream);
  CHECK(b.compute != default_stream);
  CHECK(a.copy != default_stream);
}

TEST_CASE("cuda: 2 and 4 stages on cuda:0 are transparent in every checkpoint mode", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  // inplace_mlp's 6 layers; {3, 3} and {1, 2, 1, 2}: stages that open with
  // an in-place layer.
  const auto balance = GENERATE(std::vector<int64_t>{3, 3}, std::vector<int64_t>{1, 2, 1, 2});
  // Divisible by the 4 chunks, and not.
  const auto rows = GENERATE(as<int64_t>{}, 16, 7);
  CAPTURE(mode, balance, rows);

  auto model = inplace_mlp(/*seed=*/static_cast<uint64_t>(rows));
  auto ref = deep_copy(model);
  ref->to(kGpu);
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance(balance)
                              .devices(std::vector<torch::Device>(balance.size(), kGpu))
                              .chunks(4)
                              .checkpoint(mode));
  check_params_on(*pipe, kGpu);
  check_transparent(pipe, ref, kGpu, kGpu, kGpu, rows);

  // A second step on the same Pipe accumulates grads like the Sequential.
  check_transparent(pipe, ref, kGpu, kGpu, kGpu, rows);
}

TEST_CASE("cuda: inference on cuda:0 under NoGradGuard and in eval mode", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  CAPTURE(mode);
  auto model = inplace_mlp(3);
  auto ref = deep_copy(model);
  ref->to(kGpu);
  gpipe::Pipe pipe(
      model,
      PipeOptions().balance({2, 2, 2}).devices({kGpu, kGpu, kGpu}).chunks(4).checkpoint(mode));
  const auto x = randn64({13, 4}).to(kGpu);
  // Grad mode is per thread: the guard goes where the call runs.
  auto out = within_deadline(
      [&] {
        torch::NoGradGuard no_grad;
        return pipe->forward(x);
      },
      kDeadline);
  CHECK_FALSE(out.requires_grad());
  CHECK(max_abs_diff_anywhere(out, ref->forward(x)) <= kTolerance);
  pipe->eval();
  CHECK(max_abs_diff_anywhere(within_deadline([&] { return pipe->forward(x); }, kDeadline),
                              ref->forward(x)) <= kTolerance);
}

// ---- CPU and GPU mixed --------------------------------------------------------------------------

TEST_CASE("cuda: stages on CPU and cuda:0 mixed are transparent", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  // CPU -> GPU -> GPU -> CPU (output back on the CPU: the outer backward
  // starts on the caller's thread), and CPU -> CPU -> GPU -> GPU (output on
  // the GPU: it starts on the engine's device thread, CPU stages included).
  const auto devices = GENERATE(std::vector<torch::Device>{kCpu, kGpu, kGpu, kCpu},
                                std::vector<torch::Device>{kCpu, kCpu, kGpu, kGpu});
  CAPTURE(mode, devices);

  auto model = inplace_mlp(/*seed=*/5);
  auto ref = deep_copy(model);  // stays on the CPU
  gpipe::Pipe pipe(model,
                   PipeOptions().balance({1, 2, 1, 2}).devices(devices).chunks(4).checkpoint(mode));
  // Layer k's stage under {1, 2, 1, 2}.
  const std::vector<size_t> stage_of = {0, 1, 1, 2, 3, 3};
  for (size_t k = 0; k < pipe->size(); ++k) {
    INFO("layer " << k);
    check_params_on(*pipe->ptr(k), devices[stage_of[k]]);
  }
  // Input on the CPU; output on the last stage's device.
  check_transparent(pipe, ref, kCpu, kCpu, devices.back(), /*rows=*/10);
}

TEST_CASE("cuda: an input on another device than stage 0 gets its grad where it is", "[cuda]") {
  if (!cuda_or_skip()) return;
  // The autograd engine refuses a grad on another device than its tensor
  // ("invalid gradient at index 0 - expected device ..."), so the Pipe must
  // hand the input grad back on the input's device: a CPU batch into GPU
  // stages (the usual case), and a GPU batch into a CPU first stage.
  const auto input_device = GENERATE(kCpu, kGpu);
  const auto first = input_device.is_cpu() ? kGpu : kCpu;
  CAPTURE(input_device, first);
  auto model = inplace_mlp(/*seed=*/8);
  auto ref = deep_copy(model);  // stays on the CPU
  gpipe::Pipe pipe(model, PipeOptions().balance({3, 3}).devices({first, kGpu}).chunks(3));
  check_transparent(pipe, ref, input_device, kCpu, kGpu, /*rows=*/9);
}

// ---- checkpoint memory --------------------------------------------------------------------------

TEST_CASE("cuda: checkpointing always needs clearly less memory than never", "[cuda]") {
  if (!cuda_or_skip()) return;
  const int64_t never = step_peak_bytes(Checkpoint::Never);
  const int64_t except_last = step_peak_bytes(Checkpoint::ExceptLast);
  const int64_t always = step_peak_bytes(Checkpoint::Always);
  constexpr double kMiB = 1024.0 * 1024.0;
  // Printed whether or not the checks pass: tests/gpu/run.sh's log keeps the numbers.
  WARN("checkpoint memory, peak MiB above the step's start: always "
       << always / kMiB << ", except_last " << except_last / kMiB << ", never " << never / kMiB);
  // Never keeps 32 activations of 16 MiB (every layer, every micro-batch);
  // always keeps the 4 stage inputs and one cell's recompute at a time.
  REQUIRE(never > 0);
  CHECK(static_cast<double>(always) < 0.6 * static_cast<double>(never));
  CHECK(except_last < never);
  CHECK(always <= except_last);
}

// ---- caching allocator and streams under load ---------------------------------------------------

TEST_CASE("cuda: many micro-batches, no synchronisation, results equal the plain model", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  CAPTURE(mode);
  // Four stages of unequal cost on one GPU, 32 micro-batches of 16 rows:
  // the cheap stages race ahead of the expensive one, so buffers they free
  // are reused while the next stage may still be reading the old contents,
  // unless they are recorded on the consuming stream.
  torch::manual_seed(7);
  using namespace torch::nn;
  Sequential model(Linear(64, 512), Tanh(), Linear(512, 512), Tanh(), Linear(512, 512), Tanh(),
                   Linear(512, 512), Tanh(), Linear(512, 64), Tanh(), Linear(64, 8));
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  ref->to(kGpu);
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({1, 6, 2, 2})
                              .devices({kGpu, kGpu, kGpu, kGpu})
                              .chunks(32)
                              .checkpoint(mode));

  constexpr int kSteps = 6;
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> outputs;
  std::vector<torch::Tensor> input_grads;
  within_deadline(
      [&] {
        for (int step = 0; step < kSteps; ++step) {
          auto x =
              torch::randn({512, 64}, torch::TensorOptions().dtype(torch::kFloat64).device(kGpu))
                  .requires_grad_(true);
          auto out = pipe->forward(x);
          // Churn the allocator on the caller's stream meanwhile.
          auto junk = torch::full({512, 512}, std::nan(""),
                                  torch::TensorOptions().dtype(torch::kFloat64).device(kGpu));
          out.pow(2).sum().backward();
          junk = torch::Tensor();
          inputs.push_back(x.detach());
          outputs.push_back(out.detach());
          input_grads.push_back(x.grad());
        }
      },
      kDeadline);

  // Only now compare (the comparisons synchronise).
  for (int step = 0; step < kSteps; ++step) {
    INFO("step " << step);
    auto x = inputs[step].clone().requires_grad_(true);
    auto out = ref->forward(x);
    out.pow(2).sum().backward();
    CHECK(max_abs_diff_anywhere(outputs[step], out) <= kTolerance);
    CHECK(max_abs_diff_anywhere(input_grads[step], x.grad()) <= kTolerance);
  }
  // Grads accumulated over all steps, as in the Sequential.
  check_param_grads_anywhere(*pipe, *ref);
}

// ---- failures -----------------------------------------------------------------------------------

TEST_CASE("cuda: an exception in a CUDA stage names it, and the Pipe recovers", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto phase = GENERATE(FaultPhase::Forward, FaultPhase::Backward, FaultPhase::Recompute);
  CAPTURE(phase_word(phase));
  auto plan = std::make_shared<FaultPlan>();
  auto model = faulty_model(plan);
  auto ref = deep_copy(model);
  ref->to(kGpu);
  auto pipe = faulty_pipe(model, Checkpoint::Always);

  plan->arm(1, 2, phase);
  const auto x = marked_input(8, 6, kFaultMicrobatches).to(kGpu).requires_grad_(true);
  const auto error = faulty_step(pipe, x);
  REQUIRE(error != nullptr);
  CHECK_THROWS_AS(std::rethrow_exception(error), c10::Error);
  CHECK_THROWS_AS(std::rethrow_exception(error), std::exception);
  try {
    std::rethrow_exception(error);
  } catch (const gpipe::CellError& e) {
    CHECK(e.stage() == 1);
    CHECK(e.microbatch() == 2);
    CHECK(e.phase() == phase_word(phase));
    CHECK_THAT(std::string(e.what()),
               Contains("stage 1, micro-batch 2") && Contains("boom at stage 1"));
  } catch (const std::exception& e) {
    FAIL("not a gpipe::CellError: " << e.what());
  }

  // Disarmed, the same Pipe trains like the Sequential again.
  plan->disarm();
  zero_grads(*pipe);
  zero_grads(*ref);
  const auto clean = marked_input(8, 6, kFaultMicrobatches);
  auto x_pipe = clean.clone().to(kGpu).requires_grad_(true);
  auto x_ref = clean.clone().to(kGpu).requires_grad_(true);
  REQUIRE(faulty_step(pipe, x_pipe) == nullptr);
  ref->forward(x_ref).pow(2).sum().backward();
  CHECK(max_abs_diff_anywhere(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads_anywhere(*pipe, *ref);
}

TEST_CASE("cuda: destroying a Pipe on cuda:0 right after a failure returns promptly", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto phase = GENERATE(FaultPhase::Forward, FaultPhase::Backward);
  const bool keep_output = GENERATE(false, true);
  CAPTURE(phase_word(phase), keep_output);
  auto plan = std::make_shared<FaultPlan>();
  auto pipe = faulty_pipe(faulty_model(plan), Checkpoint::ExceptLast);
  plan->arm(2, 1, phase);
  const auto x = marked_input(8, 6, kFaultMicrobatches).to(kGpu).requires_grad_(true);

  const double seconds =
      gpipe_test::seconds_to_drop_after_failure(pipe, x, keep_output, kDeadline);
  CHECK(pipe.is_empty());
  CHECK(seconds < 5.0);
}
