// engine.cpp — forward half on the workers, autograd wiring, backward half (with the CUDA deadlock rule).
#include "engine.h"

#include "pipe_backward.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <optional>

namespace gpipe::detail {

namespace {

bool differentiable(const at::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

// The stage's compute stream becomes current for the cell (nothing on CPU).
std::optional<c10::StreamGuard> on_compute_stream(const Stage& stage) {
  if (stage.device().is_cpu()) return std::nullopt;
  return std::optional<c10::StreamGuard>(std::in_place, stage.lane().compute);
}

int64_t checkpointed_microbatches(Checkpoint mode, int64_t microbatches) {
  switch (mode) {
    case Checkpoint::Always:
      return microbatches;
    case Checkpoint::ExceptLast:
      return microbatches - 1;
    case Checkpoint::Never:
      return 0;
  }
  return 0;
}

// Concatenates per-micro-batch grads of one value; micro-batches that got no
// grad contribute zeros. Undefined when no micro-batch got a grad.
at::Tensor gather_grads(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& rows) {
  const at::Tensor* any = nullptr;
  for (const auto& p : parts) {
    if (p.defined()) any = &p;
  }
  if (any == nullptr) return at::Tensor();
  if (parts.size() == 1) return parts.front();
  std::vector<at::Tensor> filled;
  filled.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].defined()) {
      filled.push_back(parts[i]);
    } else {
      auto sizes = any->sizes().vec();
      sizes[0] = rows[i];
      filled.push_back(at::zeros(sizes, any->options()));
    }
  }
  return at::cat(filled, 0);
}

/// `receive`, recorded as a copy when it moves anything across devices.
Batch receive_traced(Payload in, const Lane& lane, Tracer& tracer, int64_t step, int64_t stage,
                     int64_t microbatch) {
  bool crosses = false;
  if (tracer.enabled()) {
    for (const auto& t : in.batch.values) crosses |= t.defined() && t.device() != lane.device;
  }
  if (!crosses) return receive(std::move(in), lane);
  Span span(tracer, step, stage, microbatch, TracePhase::Copy);
  Batch out = receive(std::move(in), lane);
  span.finish();
  return out;
}

}  // namespace

Engine::Engine(std::vector<std::unique_ptr<Layers>> layers, const std::vector<c10::Device>& devices,
               int64_t chunks, Checkpoint checkpoint)
    : executor_(static_cast<int64_t>(layers.size())), chunks_(chunks), checkpoint_(checkpoint) {
  TORCH_INTERNAL_ASSERT(devices.size() >= layers.size());
  for (size_t j = 0; j < layers.size(); ++j) {
    stages_.push_back(
        std::make_unique<Stage>(static_cast<int64_t>(j), std::move(layers[j]), devices[j]));
  }
}

std::vector<Payload> Engine::execute(const Schedule& schedule, std::vector<Payload> sources,
                                     const CellFn& cell, const at::ThreadLocalState& state,
                                     bool inline_run) {
  try {
    return executor_.run(schedule, std::move(sources), cell, state, inline_run);
  } catch (const CellError& e) {
    if (error_hook_) error_hook_(e);
    throw;
  }
}

Batch Engine::forward(const Batch& input, bool training) {
  std::vector<Batch> microbatches = scatter(input, chunks_);
  const auto m = static_cast<int64_t>(microbatches.size());
  const int64_t k = stages();

  bool anything_requires_grad = false;
  for (const auto& t : input.values) anything_requires_grad |= t.requires_grad();
  for (const auto& s : stages_) anything_requires_grad |= s->layers_require_grad();
  const bool graph = at::GradMode::is_enabled() && anything_requires_grad;

  // Nothing to differentiate: run the layers without grad mode, so cells
  // keep nothing (pipelined inference).
  std::optional<at::NoGradGuard> no_grad;
  if (!graph) no_grad.emplace();

  auto run = std::make_shared<PipeRun>();
  run->engine = shared_from_this();
  run->microbatches = m;
  run->cells.assign(static_cast<size_t>(k), std::vector<Cell>(static_cast<size_t>(m)));
  run->stages.resize(static_cast<size_t>(k));
  run->input_rows = rows_of(microbatches);
  for (const auto& t : input.values) {
    run->input_devices.push_back(t.defined() ? t.device() : c10::Device(c10::kCPU));
  }
  run->forward_state.emplace();
  const int64_t step = tracer_.enabled() ? tracer_.next_step() : 0;
  run->step = step;
  const int64_t stop = graph && training ? checkpointed_microbatches(checkpoint_, m) : 0;
  for (auto& s : run->stages) s.any_checkpoint = stop > 0;

  // The input was produced on the caller's current streams: every
  // micro-batch waits for that work.
  const auto ready = from_current_streams(input).ready;
  std::vector<Payload> sources;
  sources.reserve(microbatches.size());
  for (auto& mb : microbatches) sources.push_back(Payload{std::move(mb), ready});

  PipeRun& r = *run;
  const CellFn cell = [this, &r, stop, step](int64_t j, const Action& action, Payload in,
                                             const char*& /*phase*/) {
    Stage& stage = *stages_[static_cast<size_t>(j)];
    auto guard = on_compute_stream(stage);
    const int64_t i = action.microbatch;
    Batch x = receive_traced(std::move(in), stage.lane(), tracer_, step, j, i);
    Span span(tracer_, step, j, i, TracePhase::Forward);
    Batch y = stage.forward(r.cells[static_cast<size_t>(j)][static_cast<size_t>(i)],
                            r.stages[static_cast<size_t>(j)], x, i < stop);
    span.finish();
    return Payload{std::move(y), mark(stage.lane().compute)};
  };
  // The one capture of the caller's state serves the forward cells and,
  // later, the recomputes.
  auto sinks = execute(gpipe_forward(k, m), std::move(sources), cell, *run->forward_state,
                       /*inline_run=*/false);

  std::vector<Batch> outputs;
  outputs.reserve(sinks.size());
  at::NoGradGuard plain;  // gathering is not part of any graph
  for (auto& p : sinks) outputs.push_back(settle(std::move(p)));
  run->output_rows = rows_of(outputs);
  Batch out = gather(outputs);
  if (!graph) return out;

  // Wire the outputs to one PipeBackward node whose edges lead to the inputs.
  for (auto& t : out.values) {
    if (t.defined()) t = t.detach();
  }
  auto node = std::shared_ptr<PipeBackward>(new PipeBackward(run), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input.values));
  run->output_atomic = out.atomic;
  run->output_slot.assign(out.size(), -1);
  for (size_t v = 0; v < out.size(); ++v) {
    if (!differentiable(out[v])) continue;
    run->output_slot[v] = static_cast<int64_t>(node->num_inputs());
    torch::autograd::create_gradient_edge(out[v], node);
  }
  return out;
}

std::vector<at::Tensor> Engine::backward(PipeRun& run, const std::vector<at::Tensor>& grads,
                                         bool keep_graph) {
  const int64_t m = run.microbatches;
  const int64_t k = stages();

  // Cut each output grad like the outputs were cut.
  Batch all;
  all.atomic = run.output_atomic;
  for (int64_t slot : run.output_slot) {
    all.values.push_back(slot >= 0 ? grads[static_cast<size_t>(slot)] : at::Tensor());
  }
  const auto ready = from_current_streams(all).ready;
  std::vector<Payload> sources(static_cast<size_t>(m));
  for (auto& s : sources) {
    s.batch.atomic = all.atomic;
    s.ready = ready;
  }
  for (const auto& g : all.values) {
    std::vector<at::Tensor> pieces;
    if (g.defined() && m > 1) {
      pieces = g.split_with_sizes(run.output_rows, 0);
    } else {
      pieces.assign(static_cast<size_t>(m), g);
    }
    for (int64_t i = 0; i < m; ++i) {
      sources[static_cast<size_t>(i)].batch.values.push_back(pieces[static_cast<size_t>(i)]);
    }
  }

  const CellFn cell = [this, &run, keep_graph](int64_t j, const Action& action, Payload in,
                                               const char*& phase) {
    Stage& stage = *stages_[static_cast<size_t>(j)];
    auto guard = on_compute_stream(stage);
    const int64_t i = action.microbatch;
    Cell& c = run.cells[static_cast<size_t>(j)][static_cast<size_t>(i)];
    Batch dy = receive_traced(std::move(in), stage.lane(), tracer_, run.step, j, i);
    if (c.checkpointed) {
      phase = "recompute";
      Span span(tracer_, run.step, j, i, TracePhase::Recompute);
      stage.recompute(c, *run.forward_state);
      span.finish();
      phase = "backward";
    }
    Span span(tracer_, run.step, j, i, TracePhase::Backward);
    Batch dx = stage.backward(c, dy, keep_graph);
    span.finish();
    return Payload{std::move(dx), mark(stage.lane().compute)};
  };

  // CUDA deadlock rule (DESIGN.md). The autograd engine runs a node on the
  // thread of the device its grads live on. When our outputs (hence these
  // grads) are on an accelerator, this call runs on that device's engine
  // thread, which every CUDA node of every stage's backward also needs:
  // blocking it while workers run their backward would hang. So there we
  // drive all cells from this very thread in schedule order (nested
  // backward runs inline) and rely on asynchronous kernel launches and the
  // per-stage streams for overlap. On CPU this call runs on the caller's
  // thread, and the workers run each stage's backward concurrently.
  bool on_device_thread = false;
  for (const auto& g : grads) {
    if (g.defined() && !g.device().is_cpu()) on_device_thread = true;
  }
  const at::ThreadLocalState state;
  auto sinks = execute(gpipe_backward(k, m), std::move(sources), cell, state, on_device_thread);

  std::vector<Batch> parts;
  parts.reserve(sinks.size());
  for (auto& p : sinks) parts.push_back(settle(std::move(p)));
  std::vector<at::Tensor> result;
  const size_t values = parts.empty() ? 0 : parts.front().size();
  for (size_t v = 0; v < values; ++v) {
    std::vector<at::Tensor> per_microbatch;
    per_microbatch.reserve(parts.size());
    for (const auto& p : parts) per_microbatch.push_back(p[v]);
    at::Tensor grad = gather_grads(per_microbatch, run.input_rows);
    // Autograd wants each input's grad on that input's device (a CPU batch
    // fed to CUDA stages). `settle` ordered the current streams after the
    // grads' producers, so a copy on them reads finished values.
    const c10::Device home = run.input_devices[v];
    if (grad.defined() && grad.device() != home) grad = grad.to(home);
    result.push_back(std::move(grad));
  }
  return result;
}

}  // namespace gpipe::detail
