// test_cuda.cpp — the Pipe contract on CUDA: one GPU, CPU+GPU mixed, memory, the caller's streams, trace, failures.
//
// Every case but the header check needs a CUDA device; without one it says
// "skipped: no CUDA device" (a Catch2 WARN, printed even when the case
// passes) and returns. tests/gpu/run.sh runs these on a machine with a GPU.
//
// Why these cases prove gpipe's CUDA rules (docs/gpu.md, csrc/streams.h):
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
//   * The caller's streams (streams.h): the stream helpers one at a time
//     against a "ballast" (tens of ms of matmuls) that keeps one stream busy,
//     so a missing wait reads a value before it is written, deterministically;
//     then whole training loops with optimizer.step() between steps and
//     grads read on the current stream right after backward, unsynchronised.
//   * The trace on CUDA: a cell's times are the device's (events), on the
//     host timeline; a CPU stage's backward overlaps the CUDA stage's.
#include "models.h"
#include "streams.h"
#include "trace.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

// gpipe's public headers (and torch/torch.h, which they sit beside) must not
// pull in CUDA: one libgpipe serves the CPU and the CUDA builds of torch.
// Checked here, before this file includes a CUDA header of its own.
#if defined(CUDART_VERSION) || defined(__CUDA_RUNTIME_H__) || defined(C10_CUDA_CHECK)
#error "a gpipe public header (or torch/torch.h) includes CUDA headers; keep them in csrc/"
#endif

#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cctype>
#include <chrono>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
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
using gpipe::detail::Lane;
using gpipe::detail::make_lane;

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

// ---- the caller's streams ------------------------------------------------------------------------

const torch::Device kGpu1(torch::kCUDA, 1);

/// True when two CUDA devices are present; otherwise says why the case is skipped.
bool two_gpus_or_skip() {
  if (torch::cuda::device_count() >= 2) return true;
  WARN("skipped: fewer than 2 CUDA devices");
  return false;
}

torch::TensorOptions gpu64(torch::Device device = kGpu) {
  return torch::TensorOptions().dtype(torch::kFloat64).device(device);
}

/// Keeps the current stream of `device` busy for tens of milliseconds (20
/// float32 matmuls of 4096 x 4096, values kept bounded), so whatever is
/// queued after it on that stream runs late, and a stream that does not wait
/// for it runs first.
void ballast(torch::Device device = kGpu) {
  auto a = torch::randn({4096, 4096}, torch::TensorOptions().device(device));
  for (int r = 0; r < 20; ++r) a = torch::tanh(torch::mm(a, a) / 64.0);
}

// A tensor of `n` copies of `value` made on `producer`'s compute stream
// behind a ballast: a consumer that skips a wait reads it unfinished.
torch::Tensor late_on(const gpipe::detail::Lane& producer, int64_t n, double value) {
  torch::cuda::synchronize();
  c10::StreamGuard on(producer.compute);
  ballast();
  return torch::full({n}, value, gpu64());
}

/// The named parameters of `module`, cloned on the current stream now (no
/// synchronisation: a clone reads whatever the stream is ordered after).
std::vector<torch::Tensor> grads_now(const torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (const auto& p : module.parameters()) {
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  return out;
}

/// Wide float64 layers: the GPU is still running a step's backward when the
/// host returns from it.
torch::nn::Sequential wide_mlp() {
  using namespace torch::nn;
  Sequential model(Linear(64, 2048), Tanh(), Linear(2048, 2048), Tanh(), Linear(2048, 2048),
                   Tanh(), Linear(2048, 8));
  model->to(torch::kFloat64);
  return model;
}

/// The events of `stage` and `phase`, by start time.
std::vector<gpipe::TraceEvent> events_of(const gpipe::Trace& trace, int64_t stage,
                                         gpipe::TracePhase phase) {
  std::vector<gpipe::TraceEvent> out;
  for (const auto& e : trace.events) {
    if (e.stage == stage && e.phase == phase) out.push_back(e);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.start_us < b.start_us;
  });
  return out;
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

// ---- the caller's streams: the helpers one at a time (streams.h) --------------------------------

TEST_CASE("cuda: the stream helpers do nothing on CPU lanes, a CPU copy span is host-timed",
          "[cuda]") {
  // Runs everywhere. The CPU guard's event calls throw: any event these
  // touched on a CPU lane would fail the case.
  using namespace gpipe::detail;
  const Lane lane = make_lane(kCpu);
  const std::vector<const Lane*> lanes{&lane};
  CHECK_NOTHROW(wait_for_current_streams(lanes));
  CHECK_NOTHROW(current_streams_wait_for(lanes));
  CHECK_NOTHROW(record_on_current_streams({torch::ones({2})}));
  CHECK(lane.sources->all().empty());

  Tracer tracer;
  {
    // Off: nothing is recorded, nothing is timed.
    Span off(tracer, 0, 0, 0, gpipe::TracePhase::Forward, lane.compute);
    off.finish();
  }
  tracer.enable(true);
  Span span(tracer, 0, 1, 2, gpipe::TracePhase::Copy, lane.copy);
  Batch out = receive(Payload{Batch(torch::ones({3})), {}}, lane, &span);
  span.finish();
  span.finish();  // once only
  CHECK(out[0].equal(torch::ones({3})));
  const auto events = tracer.snapshot().events;
  REQUIRE(events.size() == 1);
  CHECK(events[0].stage == 1);
  CHECK(events[0].microbatch == 2);
  CHECK(events[0].phase == gpipe::TracePhase::Copy);
  CHECK(events[0].start_us >= 0);
  CHECK(events[0].start_us <= events[0].end_us);
}

TEST_CASE("cuda: wait_for_current_streams orders every lane stream after the current stream",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  // A GPU stage's compute and copy streams, and the stream a CPU stage
  // copies from cuda:0 on.
  const Lane lane = make_lane(kGpu);
  const Lane cpu_lane = make_lane(kCpu);
  const c10::Stream source = cpu_lane.sources->on(kGpu);
  constexpr int64_t n = 1 << 20;
  auto p = torch::zeros({n}, gpu64());
  torch::cuda::synchronize();
  // The caller's optimizer.step(), late on the current stream.
  ballast();
  p.fill_(1.0);
  wait_for_current_streams({&lane, &cpu_lane});
  std::vector<torch::Tensor> seen;
  for (const auto& stream : {lane.compute, lane.copy, source}) {
    c10::StreamGuard on(stream);
    seen.push_back(p.sum());
  }
  torch::cuda::synchronize();
  for (size_t k = 0; k < seen.size(); ++k) {
    INFO("stream " << k << " (compute, copy, CPU stage's source copy)");
    CHECK(seen[k].item<double>() == static_cast<double>(n));
  }
}

TEST_CASE("cuda: current_streams_wait_for orders the current and default streams after the lanes",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  const Lane lane = make_lane(kGpu);
  const Lane cpu_lane = make_lane(kCpu);
  const c10::Stream source = cpu_lane.sources->on(kGpu);
  constexpr int64_t n = 1 << 20;
  torch::cuda::synchronize();
  // Each lane stream writes late (after a ballast of its own).
  std::vector<torch::Tensor> written;
  for (const auto& stream : {lane.compute, lane.copy, source}) {
    c10::StreamGuard on(stream);
    auto t = torch::zeros({n}, gpu64());
    ballast();
    t.fill_(2.0);
    written.push_back(t);
  }
  // The caller works on a stream of its own: it and the default stream
  // (where autograd assumes a grad from another device was made) both wait.
  const c10::Stream callers = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, 0);
  const c10::Stream default_stream(c10::Stream::DEFAULT, kGpu);
  REQUIRE(callers != default_stream);
  std::vector<torch::Tensor> on_current;
  std::vector<torch::Tensor> on_default;
  {
    c10::StreamGuard on(callers);
    current_streams_wait_for({&lane, &cpu_lane});
    for (const auto& t : written) on_current.push_back(t.sum());
    c10::StreamGuard on_default_stream(default_stream);
    for (const auto& t : written) on_default.push_back(t.sum());
  }
  torch::cuda::synchronize();
  for (size_t k = 0; k < written.size(); ++k) {
    INFO("stream " << k << " (compute, copy, CPU stage's source copy)");
    CHECK(on_current[k].item<double>() == 2.0 * n);
    CHECK(on_default[k].item<double>() == 2.0 * n);
  }
}

TEST_CASE("cuda: a grad handed to the caller is not reused by the stage stream before it is read",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  // A grad made on a stage stream, read on the caller's stream (late,
  // behind a ballast), then freed there (zero_grad()). Its block goes back
  // to the stage stream's pool, where the next allocation of that size gets
  // it at once, unless it was recorded on the caller's stream.
  const Lane lane = make_lane(kGpu);
  constexpr int64_t n = 1 << 21;  // 16 MiB
  torch::cuda::synchronize();
  torch::Tensor g;
  {
    c10::StreamGuard on(lane.compute);
    g = torch::full({n}, 3.0, gpu64());
  }
  current_streams_wait_for({&lane});
  record_on_current_streams({g});
  ballast();
  const auto read = g.sum();
  g = torch::Tensor();
  torch::Tensor next;
  {
    c10::StreamGuard on(lane.compute);
    next = torch::full({n}, std::nan(""), gpu64());
  }
  torch::cuda::synchronize();
  CHECK(read.item<double>() == 3.0 * n);
}

TEST_CASE("cuda: receive orders a CUDA stage after its producer and the host", "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  const Lane producer = make_lane(kGpu);
  const Lane lane = make_lane(kGpu);
  constexpr int64_t n = 1 << 20;
  torch::Tensor y = late_on(producer, n, 7.0);
  const auto host = torch::full({n}, 3.0, torch::dtype(torch::kFloat64));
  Payload in{Batch({y, host}, /*is_atomic=*/false), mark(producer.compute)};
  y = torch::Tensor();
  Batch got = receive(std::move(in), lane);
  REQUIRE(got[0].device() == kGpu);
  REQUIRE(got[1].device() == kGpu);
  torch::Tensor sum;
  {
    c10::StreamGuard on(lane.compute);
    sum = got[0].sum() + got[1].sum();
  }
  torch::cuda::synchronize();
  CHECK(sum.item<double>() == 10.0 * n);
  // Nothing came from another accelerator.
  CHECK(lane.sources->all().empty());
}

TEST_CASE("cuda: a CPU stage copies a CUDA batch out on a copy stream of the source device",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  const Lane producer = make_lane(kGpu);
  const Lane cpu_lane = make_lane(kCpu);
  constexpr int64_t n = 1 << 20;
  torch::Tensor y = late_on(producer, n, 5.0);
  Payload in{Batch(y), mark(producer.compute)};
  y = torch::Tensor();
  Tracer tracer;
  tracer.enable(true);
  Span span(tracer, 0, 1, 0, gpipe::TracePhase::Copy, cpu_lane.copy);
  Batch got = receive(std::move(in), cpu_lane, &span);
  span.finish();
  REQUIRE(got[0].device().is_cpu());
  CHECK(got[0].sum().item<double>() == 5.0 * n);
  const auto used = cpu_lane.sources->all();
  REQUIRE(used.size() == 1);
  CHECK(used[0].device() == kGpu);
  CHECK(used[0] != c10::Stream(c10::Stream::DEFAULT, kGpu));
  // The copy span started after the producer finished: it is short.
  const auto events = tracer.snapshot().events;
  REQUIRE(events.size() == 1);
  CHECK(events[0].end_us - events[0].start_us < 20000.0);
}

TEST_CASE("cuda: a copy from cuda:0 into a stage on cuda:1 runs on a copy stream of cuda:0",
          "[cuda]") {
  if (!cuda_or_skip() || !two_gpus_or_skip()) return;
  using namespace gpipe::detail;
  const Lane producer = make_lane(kGpu);
  const Lane lane = make_lane(kGpu1);
  constexpr int64_t n = 1 << 20;
  torch::Tensor y = late_on(producer, n, 9.0);
  Payload in{Batch(y), mark(producer.compute)};
  y = torch::Tensor();
  Batch got = receive(std::move(in), lane);
  REQUIRE(got[0].device() == kGpu1);
  torch::Tensor sum;
  {
    c10::StreamGuard on(lane.compute);
    sum = got[0].sum();
  }
  torch::cuda::synchronize();
  CHECK(sum.item<double>() == 9.0 * n);
  const auto used = lane.sources->all();
  REQUIRE(used.size() == 1);
  CHECK(used[0].device() == kGpu);
  CHECK(used[0] != c10::Stream(c10::Stream::DEFAULT, kGpu));
}

// ---- the trace on CUDA (trace.h) ----------------------------------------------------------------

TEST_CASE("cuda: a span on a CUDA stream is timed by the device, on the host timeline", "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  using Micro = std::chrono::duration<double, std::micro>;
  using Clock = Tracer::Clock;
  const Lane lane = make_lane(kGpu);
  {
    c10::StreamGuard on(lane.compute);
    ballast();  // warm-up: cuBLAS on this stream
  }
  torch::cuda::synchronize();
  Tracer tracer;
  tracer.enable(true);
  const auto t0 = Clock::now();
  Span span(tracer, 0, 0, 0, gpipe::TracePhase::Forward, lane.compute);
  {
    c10::StreamGuard on(lane.compute);
    ballast();
  }
  span.finish();
  const auto queued = Clock::now();
  torch::cuda::synchronize();
  const auto t1 = Clock::now();
  const auto trace = tracer.snapshot();
  REQUIRE(trace.events.size() == 1);
  const auto& e = trace.events[0];
  const double begin_us = Micro(t0 - tracer.origin()).count();
  const double queued_us = Micro(queued - tracer.origin()).count();
  const double end_us = Micro(t1 - tracer.origin()).count();
  INFO("host: queued " << queued_us - begin_us << " us, done " << end_us - begin_us
                       << " us; event " << e.start_us - begin_us << " .. " << e.end_us - begin_us);
  // The device ran the ballast for most of the time the host waited, far
  // longer than the host took to queue it (what a host-timed span records).
  CHECK(e.end_us - e.start_us > 0.5 * (end_us - begin_us));
  CHECK(e.end_us > queued_us);
  // On the host timeline: inside [t0, t1], give or take a millisecond.
  CHECK(e.start_us >= begin_us - 1000.0);
  CHECK(e.end_us <= end_us + 1000.0);
}

TEST_CASE("cuda: thousands of device-timed spans resolve in order, also while pending", "[cuda]") {
  if (!cuda_or_skip()) return;
  using namespace gpipe::detail;
  // More spans than the Tracer keeps pending, so some are resolved while
  // recording (against another reference than the rest).
  const Lane lane = make_lane(kGpu);
  Tracer tracer;
  tracer.enable(true);
  constexpr int64_t spans = 6000;
  auto x = torch::ones({1024, 1024}, torch::TensorOptions().device(kGpu));
  {
    c10::StreamGuard on(lane.compute);
    for (int64_t i = 0; i < spans; ++i) {
      Span span(tracer, 0, 0, i, gpipe::TracePhase::Forward, lane.compute);
      x = torch::tanh(torch::mm(x, x) / 1024.0);
      span.finish();
    }
  }
  auto events = tracer.snapshot().events;
  REQUIRE(events.size() == static_cast<size_t>(spans));
  for (size_t k = 1; k < events.size(); ++k) {
    INFO("event " << k);
    REQUIRE(events[k].end_us >= events[k - 1].end_us);  // the trace is ordered by end
  }
  // One stream ran them one after another: each starts after the one queued
  // before it ended (times resolved against different references may differ
  // by some microseconds).
  std::sort(events.begin(), events.end(),
            [](const auto& a, const auto& b) { return a.microbatch < b.microbatch; });
  for (int64_t i = 0; i < spans; ++i) {
    const auto& e = events[static_cast<size_t>(i)];
    INFO("span " << i);
    REQUIRE(e.microbatch == i);
    CHECK(e.end_us >= e.start_us);
    if (i > 0) CHECK(e.start_us >= events[static_cast<size_t>(i - 1)].end_us - 50.0);
  }
}

// ---- the caller's streams: whole training loops -------------------------------------------------

TEST_CASE("cuda: 20 steps with optimizer.step() between them, CPU input, GPU stages", "[cuda]") {
  if (!cuda_or_skip()) return;
  const auto mode = GENERATE(Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  // optimizer.step() updates the parameters in place on the current stream,
  // late (behind a ballast): the next forward's stages must wait for it, or
  // they compute with the old parameters and the runs drift apart. The grads
  // it reads must be the finished ones. zero_grad() frees them every step.
  torch::manual_seed(11);
  using namespace torch::nn;
  Sequential model(Linear(32, 256), Tanh(), Linear(256, 256), Tanh(), Linear(256, 256), Tanh(),
                   Linear(256, 4));
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  ref->to(kGpu);
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({2, 2, 2, 1})
                              .devices({kGpu, kGpu, kGpu, kGpu})
                              .chunks(8)
                              .checkpoint(mode));
  constexpr int kSteps = 20;
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  for (int step = 0; step < kSteps; ++step) {
    inputs.push_back(randn64({128, 32}));  // on the CPU
    targets.push_back(randn64({128, 4}));
  }
  auto run = [&](torch::nn::Module& module, auto&& forward, bool late) {
    torch::optim::SGD sgd(module.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<torch::Tensor> losses;
    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      auto out = forward(inputs[step]);
      auto loss = torch::mse_loss(out, targets[step].to(out.device()));
      loss.backward();
      if (late) ballast();
      sgd.step();
      losses.push_back(loss.detach());
    }
    return losses;
  };
  const auto got = within_deadline(
      [&] { return run(*pipe, [&](const torch::Tensor& x) { return pipe->forward(x); }, true); },
      kDeadline);
  const auto want =
      run(*ref, [&](const torch::Tensor& x) { return ref->forward(x.to(kGpu)); }, false);
  for (int step = 0; step < kSteps; ++step) {
    INFO("step " << step);
    CHECK(max_abs_diff_anywhere(got[step], want[step]) <= kTolerance);
  }
  const auto params = pipe->named_parameters();
  for (const auto& item : ref->named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(max_abs_diff_anywhere(params[item.key()], item.value()) <= kTolerance);
  }
}

TEST_CASE("cuda: grads read on the current stream right after backward equal the plain model's",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  // All stages on cuda:0 (backward() reaches the Pipe on the autograd
  // engine's cuda:0 thread), or CPU -> GPU -> GPU -> CPU (on this thread).
  const auto devices = GENERATE(std::vector<torch::Device>{kGpu, kGpu, kGpu, kGpu},
                                std::vector<torch::Device>{kCpu, kGpu, kGpu, kCpu});
  CAPTURE(devices);
  // Wide float64 layers: the GPU is still running the backward when the
  // host returns from it, so a clone on the current stream that is not
  // ordered after the stages reads half-written grads.
  torch::manual_seed(12);
  auto model = wide_mlp();
  auto ref = deep_copy(model);  // stays on the CPU
  gpipe::Pipe pipe(model,
                   PipeOptions().balance({2, 2, 2, 1}).devices(devices).chunks(8).checkpoint(
                       Checkpoint::Never));
  constexpr int kSteps = 3;
  std::vector<torch::Tensor> inputs;
  for (int step = 0; step < kSteps; ++step) inputs.push_back(randn64({2048, 64}));
  const auto got = within_deadline(
      [&] {
        std::vector<std::vector<torch::Tensor>> grads;
        for (int step = 0; step < kSteps; ++step) {
          for (auto& p : pipe->parameters()) p.mutable_grad() = torch::Tensor();
          pipe->forward(inputs[step]).pow(2).mean().backward();
          grads.push_back(grads_now(*pipe));  // no synchronisation
        }
        return grads;
      },
      kDeadline);
  for (int step = 0; step < kSteps; ++step) {
    INFO("step " << step);
    for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
    ref->forward(inputs[step]).pow(2).mean().backward();
    const auto want = grads_now(*ref);
    REQUIRE(got[step].size() == want.size());
    for (size_t k = 0; k < want.size(); ++k) {
      INFO("parameter " << k);
      CHECK(max_abs_diff_anywhere(got[step][k], want[k]) <= kTolerance);
    }
  }
}

TEST_CASE("cuda: backward() under another stream than the forward's returns after the stages' "
          "grads (the stream leaves)",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  // Issue 23 item 10. The forward runs under the default stream, backward()
  // and the clones of the grads under a stream of their own: the stages add
  // the grads into .grad themselves (no AccumulateGrad node runs), so only
  // the Pipe's stream leaves order that stream after them. Wide float64
  // layers keep the GPU busy well after the host returns.
  torch::manual_seed(15);
  auto model = wide_mlp();
  auto ref = deep_copy(model);  // stays on the CPU
  gpipe::Pipe pipe(model, PipeOptions().balance({2, 2, 2, 1}).devices({kGpu, kGpu, kGpu, kGpu})
                              .chunks(8)
                              .checkpoint(Checkpoint::Never));
  const auto x = randn64({2048, 64});
  const auto got = within_deadline(
      [&] {
        auto loss = pipe->forward(x).pow(2).mean();
        const c10::Stream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, 0);
        c10::Event loss_ready(c10::DeviceType::CUDA);
        loss_ready.record(c10::Stream(c10::Stream::DEFAULT, kGpu));
        loss_ready.block(side);
        c10::StreamGuard on_side(side);
        loss.backward();
        return grads_now(*pipe);  // no synchronisation
      },
      kDeadline);
  ref->forward(x).pow(2).mean().backward();
  const auto want = grads_now(*ref);
  REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    INFO("parameter " << k);
    CHECK(max_abs_diff_anywhere(got[k], want[k]) <= kTolerance);
  }
}

TEST_CASE("cuda: CPU and cuda:0 stages: the CPU stage's backward overlaps the GPU stage's",
          "[cuda]") {
  if (!cuda_or_skip()) return;
  // Stage 0 on the CPU, stage 1 on cuda:0 with milliseconds of work per
  // micro-batch. The output is on cuda:0, so
  // PipeBackward runs on the autograd engine's cuda:0 thread: stage 1 runs
  // inline there, stage 0 keeps its worker (the deadlock rule decided by the
  // thread), so the CPU stage's backward of micro-batch i runs while the GPU
  // still runs stage 1's backward of i-1. The trace shows it only if stage
  // 1's cells are timed by the device (the host merely queues them).
  torch::manual_seed(13);
  using namespace torch::nn;
  Sequential model(Linear(64, 256), ReLU(), Linear(256, 256));  // stage 0
  model->push_back(Linear(256, 2048));                            // stage 1
  for (int k = 0; k < 8; ++k) {
    model->push_back(ReLU());
    model->push_back(Linear(2048, 2048));
  }
  model->push_back(Linear(2048, 8));
  const int64_t stage1 = static_cast<int64_t>(model->size()) - 3;
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({3, stage1})
                              .devices({kCpu, kGpu})
                              .chunks(4)
                              .checkpoint(Checkpoint::Never));
  const auto x = torch::randn({8192, 64});
  auto step = [&] { pipe->forward(x).pow(2).mean().backward(); };
  within_deadline(step, kDeadline);  // warm-up: cuBLAS, the allocator
  torch::cuda::synchronize();
  pipe->set_tracing(true);
  within_deadline(step, kDeadline);
  const auto trace = pipe->trace();
  pipe->set_tracing(false);

  const auto f0 = events_of(trace, 0, gpipe::TracePhase::Forward);
  const auto b0 = events_of(trace, 0, gpipe::TracePhase::Backward);
  const auto b1 = events_of(trace, 1, gpipe::TracePhase::Backward);
  REQUIRE(b0.size() == 4);
  REQUIRE(b1.size() == 4);
  // Threads: stage 0's backward on its worker (the thread of its forward),
  // never on the thread that ran stage 1's backward (cuda:0's engine thread).
  std::set<int64_t> worker;
  std::set<int64_t> engine;
  for (const auto& e : f0) worker.insert(e.thread);
  for (const auto& e : b1) engine.insert(e.thread);
  for (const auto& e : b0) {
    INFO("stage 0, backward " << e.microbatch << " on thread " << e.thread);
    CHECK(worker.count(e.thread) == 1);
    CHECK(engine.count(e.thread) == 0);
  }
  // Time: some backward cell of stage 0 overlaps one of stage 1.
  bool overlap = false;
  for (const auto& a : b0) {
    for (const auto& b : b1) overlap |= a.start_us < b.end_us && b.start_us < a.end_us;
  }
  std::ostringstream cells;
  for (const auto* stage : {&b0, &b1}) {
    for (const auto& e : *stage) {
      cells << " stage " << e.stage << " B" << e.microbatch << " [" << e.start_us << ", "
            << e.end_us << "]";
    }
  }
  INFO("backward cells (us):" << cells.str());
  CHECK(overlap);
  // Stage 0's B(i) needs stage 1's B(i): it starts after it ended, on the
  // common timeline (within the placement error of device times).
  for (const auto& a : b0) {
    for (const auto& b : b1) {
      if (a.microbatch == b.microbatch) CHECK(a.start_us >= b.end_us - 200.0);
    }
  }
}

TEST_CASE("cuda: stages alternating between cuda:0 and cuda:1 are transparent", "[cuda]") {
  if (!cuda_or_skip() || !two_gpus_or_skip()) return;
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  CAPTURE(mode);
  // Every hand-over is a device-to-device copy, forward and backward.
  auto model = inplace_mlp(/*seed=*/9);
  auto ref = deep_copy(model);  // stays on the CPU
  gpipe::Pipe pipe(model, PipeOptions()
                              .balance({1, 2, 1, 2})
                              .devices({kGpu, kGpu1, kGpu, kGpu1})
                              .chunks(4)
                              .checkpoint(mode));
  check_transparent(pipe, ref, kGpu, kCpu, kGpu1, /*rows=*/12);
  check_transparent(pipe, ref, kCpu, kCpu, kGpu1, /*rows=*/12);
}
