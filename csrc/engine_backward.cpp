// engine_backward.cpp — Engine::backward: the drop-in backward of a forward's run, its phases as named functions, and which stages run on an autograd device thread.
#include "engine.h"

#include "pipe_backward.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/ops/add.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

namespace gpipe::detail {

namespace {

// The accelerator index whose autograd engine thread is the calling thread,
// if it is one. The engine names those threads "pt_autograd_<index>" (one per
// index, serving that index of every accelerator type); the thread that
// called backward(), which runs the CPU nodes, has any other name.
std::optional<c10::DeviceIndex> autograd_device_thread() {
  char name[16] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return std::nullopt;
  constexpr const char* kPrefix = "pt_autograd_";
  const size_t prefix = std::strlen(kPrefix);
  if (std::strncmp(name, kPrefix, prefix) != 0 || name[prefix] == '\0') return std::nullopt;
  char* end = nullptr;
  const long index = std::strtol(name + prefix, &end, 10);
  if (*end != '\0' || index < 0) return std::nullopt;
  return static_cast<c10::DeviceIndex>(index);
}

}  // namespace

std::vector<bool> stages_inline_on(c10::DeviceIndex thread,
                                   const std::vector<c10::Device>& stage_devices,
                                   const std::vector<std::vector<c10::Device>>& graph_devices) {
  TORCH_INTERNAL_ASSERT(graph_devices.size() == stage_devices.size());
  auto served = [thread](const c10::Device& device) {
    return !device.is_cpu() && device.index() == thread;
  };
  std::vector<bool> out(stage_devices.size(), false);
  for (size_t j = 0; j < stage_devices.size(); ++j) {
    out[j] = served(stage_devices[j]) ||
             std::any_of(graph_devices[j].begin(), graph_devices[j].end(), served);
  }
  return out;
}

namespace {

// The backward half's phases, in the order Engine::backward runs them.

// 1. Each output grad cut as the outputs were: one payload per micro-batch,
// ready after the caller's current streams.
std::vector<Payload> cut_output_grads(const PipeRun& run, const std::vector<at::Tensor>& grads) {
  const int64_t m = run.microbatches;
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
  for (size_t v = 0; v < all.size(); ++v) {
    const auto pieces = cut_grad(all[v], run.output_cuts[v], m);
    for (int64_t i = 0; i < m; ++i) {
      sources[static_cast<size_t>(i)].batch.values.push_back(pieces[static_cast<size_t>(i)]);
    }
  }
  return sources;
}

// 2. Which grads each stage must produce, as autograd asked (`needed`: the
// inputs' then the external edges'). A stage that owes nothing skips its
// cells (and recomputes).
struct GradWants {
  /// Stage 0: the input values' grads it is asked for; stage j > 0: its
  /// inputs' when anything upstream needs them (and its graphs reach them).
  std::vector<bool> input;
  /// Whether a cell of the stage reaches an external edge autograd wants.
  std::vector<bool> external;
  /// Whether anything before stage j (or j itself) wants a grad it makes; a
  /// stage's main input grads serve stage j - 1, a popped skip's grad the
  /// stashing stage.
  std::vector<bool> owes;

  GradWants(const PipeRun& run, const Skips& skips, const std::vector<bool>& needed,
            int64_t stages) {
    const auto k = static_cast<size_t>(stages);
    const size_t inputs = run.input_devices.size();
    input.assign(k, false);
    external.assign(k, false);
    owes.assign(k, false);
    for (size_t j = 0; j < k; ++j) {
      for (const auto& c : run.cells[j]) {
        for (const auto& edge : c.cut.externals) {
          const int64_t id = run.externals.find(edge);
          if (id >= 0 && needed[inputs + static_cast<size_t>(id)]) external[j] = true;
        }
      }
    }
    for (size_t v = 0; v < inputs; ++v) input[0] = input[0] || needed[v];
    for (size_t j = 0; j < k; ++j) {
      if (j > 0) input[j] = owes[j - 1];
      for (int64_t route : skips.arriving[j]) {
        const auto from = static_cast<size_t>(skips.routes[static_cast<size_t>(route)].from);
        input[j] = input[j] || owes[from];
      }
      owes[j] = input[j] || external[j];
    }
    // A stage whose graphs reach no input passes no grad back: the stages
    // before it get none from it.
    for (size_t j = 0; j < k; ++j) input[j] = input[j] && run.reaches_input[j];
  }

  /// Which of a cell's `values` input values (the main ones, then one per
  /// arriving skip) stage j must give grads for.
  std::vector<bool> of_cell(int64_t j, size_t values, const std::vector<bool>& needed,
                            const Skips& skips) const {
    const auto& arriving = skips.arriving[static_cast<size_t>(j)];
    TORCH_INTERNAL_ASSERT(values >= arriving.size());
    const size_t main = values - arriving.size();
    if (j > 0 && !input[static_cast<size_t>(j)]) return std::vector<bool>(values, false);
    std::vector<bool> wanted(values, j > 0 && owes[static_cast<size_t>(j - 1)]);
    if (j == 0) {
      for (size_t v = 0; v < values && v < needed.size(); ++v) wanted[v] = needed[v];
    }
    for (size_t a = 0; a < arriving.size(); ++a) {
      const auto& route = skips.routes[static_cast<size_t>(arriving[a])];
      wanted[main + a] = owes[static_cast<size_t>(route.from)];
    }
    return wanted;
  }
};

// 3. Leaves whose grads go straight into .grad (see PipeBackward), each
// through its own slot (graph.h), micro-batch by micro-batch in the one
// stage's order. Not a leaf that cells of several stages reach (a weight
// tied across stages): their workers would add into .grad in whatever
// order they come, and float sums depend on the order. Its grads are summed
// per stage and the stages' sums added in stage order (ExternalSums), so a
// seeded run gives bitwise the same grad every time; autograd then adds the
// total into .grad.
std::vector<torch::autograd::AccumulateGrad*> direct_accumulators(
    const PipeRun& run, const std::vector<bool>& accumulate) {
  const size_t externals = run.externals.size();
  TORCH_INTERNAL_ASSERT(accumulate.size() == externals);
  std::vector<int> reached_by(externals, 0);
  for (const auto& cells : run.cells) {
    std::vector<char> seen(externals, 0);
    for (const auto& c : cells) {
      for (const auto& edge : c.cut.externals) {
        const int64_t id = run.externals.find(edge);
        if (id < 0 || seen[static_cast<size_t>(id)] != 0) continue;
        seen[static_cast<size_t>(id)] = 1;
        ++reached_by[static_cast<size_t>(id)];
      }
    }
  }
  std::vector<torch::autograd::AccumulateGrad*> accumulators(externals, nullptr);
  for (size_t e = 0; e < externals; ++e) {
    if (accumulate[e] && reached_by[e] == 1) {
      accumulators[e] =
          dynamic_cast<torch::autograd::AccumulateGrad*>(run.externals.edges()[e].function.get());
      TORCH_INTERNAL_ASSERT(accumulators[e] != nullptr);
    }
  }
  return accumulators;
}

// 4. Each stage sums its cells' grads for the external edges on its own
// worker; the stages' sums are added at the end, in stage order. A sum
// starts as the first grad itself (autograd's, not to be written to) and
// becomes a tensor of our own at the second, which later grads are added
// into in place: one allocation per edge and step, as AccumulateGrad does.
class ExternalSums {
 public:
  ExternalSums(int64_t stages, size_t externals)
      : sums_(static_cast<size_t>(stages), std::vector<at::Tensor>(externals)),
        owned_(static_cast<size_t>(stages), std::vector<char>(externals, 0)) {}

  /// Adds `grad` (stage j's, for external edge `id`); only stage j's worker calls it.
  void add(int64_t j, size_t id, at::Tensor grad) {
    auto& total = sums_[static_cast<size_t>(j)][id];
    char& own = owned_[static_cast<size_t>(j)][id];
    if (!total.defined()) {
      total = std::move(grad);
    } else if (own == 0) {
      total = at::add(total, grad);
      own = 1;
    } else {
      total.add_(grad);
    }
  }

  /// The total per edge, the stages' sums added in stage order once each
  /// stage's compute stream finished them (the current streams wait).
  std::vector<at::Tensor> total(const std::vector<std::unique_ptr<Stage>>& stages) {
    const size_t externals = sums_.empty() ? 0 : sums_.front().size();
    std::vector<at::Tensor> out(externals);
    for (size_t j = 0; j < sums_.size(); ++j) {
      Batch stage_sums(std::move(sums_[j]), /*is_atomic=*/false);
      Batch ready = settle(Payload{std::move(stage_sums), mark(stages[j]->lane().compute)});
      for (size_t e = 0; e < externals; ++e) {
        auto& g = ready[e];
        if (!g.defined()) continue;
        out[e] = out[e].defined() ? at::add(out[e], g) : std::move(g);
      }
    }
    return out;
  }

 private:
  std::vector<std::vector<at::Tensor>> sums_;
  std::vector<std::vector<char>> owned_;
};

// 5. CUDA deadlock rule (docs/gpu.md). The autograd engine runs each node on
// one thread per device: CPU nodes on the thread that called backward(),
// an accelerator's nodes on that device's engine thread. When this call
// runs on device d's engine thread, every cell of a stage on device d
// needs that very thread for its nested backward: blocking it while a
// worker runs such a cell would hang. So the stages on device d run
// inline here, in schedule order (nested backward runs on this thread),
// and every other stage (other devices, CPU) keeps its worker, so
// backward still overlaps across devices on the host. A stage elsewhere
// whose graph has a node on device d (a buffer moved to the output's
// device, a tensor a layer closes over) needs this thread as much: it
// runs inline too (stages_inline_on).
//
//   pt_autograd_d:  PipeBackward -> B(stages on d, or reaching d), inline, in order
//   workers:                        B(other stages), concurrently
std::vector<bool> inline_stages(const PipeRun& run,
                                const std::vector<std::unique_ptr<Stage>>& stages) {
  const auto d = autograd_device_thread();
  if (!d) return {};
  std::vector<c10::Device> devices;
  std::vector<std::vector<c10::Device>> reached(stages.size());
  for (size_t j = 0; j < stages.size(); ++j) {
    devices.push_back(stages[j]->device());
    for (const auto& c : run.cells[j]) {
      reached[j].insert(reached[j].end(), c.cut.devices.begin(), c.cut.devices.end());
    }
  }
  return stages_inline_on(*d, devices, reached);
}

// 6. The input values' grads, the micro-batches' joined as the inputs were
// cut, each on its input's device.
std::vector<at::Tensor> join_input_grads(const PipeRun& run, std::vector<Payload> sinks) {
  std::vector<Batch> parts;
  parts.reserve(sinks.size());
  for (auto& p : sinks) parts.push_back(settle(std::move(p)));
  std::vector<at::Tensor> result;
  const size_t values = parts.empty() ? 0 : parts.front().size();
  for (size_t v = 0; v < values; ++v) {
    std::vector<at::Tensor> per_microbatch;
    per_microbatch.reserve(parts.size());
    for (const auto& p : parts) per_microbatch.push_back(p[v]);
    at::Tensor grad = join_grads(per_microbatch, run.input_cuts[v]);
    // Autograd wants each input's grad on that input's device (a CPU batch
    // fed to CUDA stages). `settle` ordered the current streams after the
    // grads' producers, so a copy on them reads finished values.
    const c10::Device home = run.input_devices[v];
    if (grad.defined() && grad.device() != home) grad = grad.to(home);
    result.push_back(std::move(grad));
  }
  result.resize(run.input_devices.size());
  return result;
}

}  // namespace

std::vector<at::Tensor> Engine::backward(PipeRun& run, const std::vector<at::Tensor>& grads,
                                         bool keep_graph, const std::vector<bool>& needed,
                                         const std::vector<bool>& accumulate) {
  Call call(*this, "backward");
  run.input_watch.check("an input of the Pipe");
  const int64_t m = run.microbatches;
  const int64_t k = stages();
  const size_t inputs = run.input_devices.size();
  const size_t externals = run.externals.size();
  TORCH_INTERNAL_ASSERT(needed.size() == inputs + externals);

  std::vector<Payload> sources = cut_output_grads(run, grads);
  const GradWants wants(run, skips_, needed, k);
  const std::vector<bool> needed_inputs(needed.begin(),
                                        needed.begin() + static_cast<std::ptrdiff_t>(inputs));
  const auto accumulators = direct_accumulators(run, accumulate);
  auto accumulator_slots = std::make_unique<GradSlot[]>(externals);
  ExternalSums sums(k, externals);
  // Skip grads go straight back to the stashing stage, which gets them
  // before the next stage's grad (the popping stage hands i on after it
  // sent them): no receive here waits.
  Mailboxes skip_mail(k, m, skips_.size());

  // One cell: stage j's backward of micro-batch i (recomputed first if
  // checkpointed), on stage j's worker.
  const CellFn cell = [this, &run, &sums, &accumulators, &accumulator_slots, &needed,
                       &needed_inputs, &wants, &skip_mail, inputs,
                       keep_graph](int64_t j, const Action& action, Payload in,
                                   const char*& phase) {
    Stage& stage = *stages_[static_cast<size_t>(j)];
    auto guard = on_compute_stream(stage);
    const int64_t i = action.microbatch;
    Cell& c = run.cells[static_cast<size_t>(j)][static_cast<size_t>(i)];
    Batch dy = receive_traced(std::move(in), stage.lane(), tracer_, run.step, j, i);
    const auto& leaving = skips_.leaving[static_cast<size_t>(j)];
    const auto& arriving = skips_.arriving[static_cast<size_t>(j)];
    if (!leaving.empty()) {
      const bool received = receive_skips(skip_mail, Flow::SkipGrad, leaving, j, i, dy,
                                          stage.lane(), tracer_, run.step);
      TORCH_INTERNAL_ASSERT(received);
    }
    const size_t values = c.checkpointed ? c.saved.size() : c.input_sinks.size();
    const std::vector<bool> wanted_inputs = wants.of_cell(j, values, needed_inputs, skips_);
    bool any_grad = false;
    for (const auto& g : dy.values) any_grad = any_grad || g.defined();
    if (!any_grad ||
        (!wants.input[static_cast<size_t>(j)] && !wants.external[static_cast<size_t>(j)])) {
      // Nothing flows into this cell, or nothing it could give is asked for:
      // no recompute, no backward, as autograd would not run them.
      Batch nothing(std::vector<at::Tensor>(values), c.input_atomic);
      if (!keep_graph) c = Cell();
      send_skips(skip_mail, Flow::SkipGrad, arriving, skips_, i, nothing, {});
      return Payload{std::move(nothing), {}};
    }
    if (c.checkpointed) {
      phase = "recompute";
      Span span(tracer_, run.step, j, i, TracePhase::Recompute, stage.lane().compute);
      stage.recompute(c, *run.forward_state);
      span.finish();
      phase = "backward";
    }
    const auto& outside = c.cut.externals;
    std::vector<int64_t> ids(outside.size());
    std::vector<ExternalSink> sinks(outside.size());
    for (size_t e = 0; e < outside.size(); ++e) {
      ids[e] = run.externals.find(outside[e]);
      TORCH_CHECK(ids[e] >= 0, "stage ", j, "'s recompute of micro-batch ", i,
                  " reached a tensor its first forward did not (", outside[e].function->name(),
                  "): the layers must build the same graph when run again on the same input");
      const auto id = static_cast<size_t>(ids[e]);
      sinks[e].wanted = needed[inputs + id];
      sinks[e].accumulate = accumulators[id];
      sinks[e].slot = &accumulator_slots[id];
    }
    Span span(tracer_, run.step, j, i, TracePhase::Backward, stage.lane().compute);
    std::vector<at::Tensor> external_grads;
    Batch dx = stage.backward(c, dy, keep_graph, wanted_inputs, sinks, external_grads);
    for (size_t e = 0; e < external_grads.size(); ++e) {
      if (external_grads[e].defined()) {
        sums.add(j, static_cast<size_t>(ids[e]), std::move(external_grads[e]));
      }
    }
    span.finish();
    auto ready = mark(stage.lane().compute);
    if (!arriving.empty()) send_skips(skip_mail, Flow::SkipGrad, arriving, skips_, i, dx, ready);
    return Payload{std::move(dx), std::move(ready)};
  };

  const auto on_this_thread = inline_stages(run, stages_);
  const at::ThreadLocalState state;
  // Ordered with the caller's streams both ways, as the forward (streams.h):
  // optimizer.step() reads the grads on the current streams.
  const auto lanes = this->lanes();
  wait_for_current_streams(lanes);
  std::vector<Payload> sinks;
  try {
    sinks = execute(gpipe_backward(k, m), std::move(sources), cell, state, on_this_thread);
  } catch (...) {
    current_streams_wait_for(lanes);
    throw;
  }
  std::vector<at::Tensor> result = join_input_grads(run, std::move(sinks));
  // The external grads were summed on each stage's compute stream: `settle`
  // orders the current streams after that work.
  for (auto& g : sums.total(stages_)) result.push_back(std::move(g));
  // Last, after the copies home: every current stream the grads may be
  // read from comes after every lane and every such copy (streams.h).
  std::vector<c10::Device> homes;
  for (const auto& g : result) {
    if (g.defined()) homes.push_back(g.device());
  }
  current_streams_wait_for(lanes, homes);
  return result;
}

}  // namespace gpipe::detail
