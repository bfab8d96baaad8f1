// stage.cpp — a cell's forward (plain or checkpointed), its exact recompute, and its backward.
#include "stage.h"

#include "cancel.h"
#include "graph.h"
#include "phase.h"
#include "rng.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

namespace gpipe::detail {

namespace {

using torch::autograd::variable_list;

// mutates_input_: whether the layers modify their input in place.
constexpr int kUnknown = 0;
constexpr int kMutates = 1;
constexpr int kKeeps = 2;
// draws_[g]: whether the stage's cells draw from generator g in this step.
constexpr int kDraws = 1;
constexpr int kDrawsNot = 2;

bool can_require_grad(const at::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

// The layers' input for a graph-building forward: aliases of the input
// whose grads end in a node of the cell's own, one per input needing grad.
//
//   input sink k (Capture, one input) <- alias k <- layers (may work in place)
//
// Not leaves: a stage's first layer may modify its input in place
// (ReLU(inplace=true)), which autograd refuses on a leaf requiring grad, and
// a leaf's accumulator would be one more node for autograd to run per input
// and cell (~1.5 us each). The cell's backward points each wanted sink at
// the slot of that input's grad; a sink no grad reaches leaves its input
// without one (not zeros): the stage before then runs no backward for it,
// as in the plain model.
struct Entry {
  Batch input;
  std::vector<std::shared_ptr<Capture>> sinks;
};

Entry enter(const Batch& input, const std::vector<bool>& requires_grad) {
  Entry e{input, std::vector<std::shared_ptr<Capture>>(input.size())};
  for (size_t k = 0; k < input.size(); ++k) {
    if (!input[k].defined()) continue;
    at::Tensor alias = input[k].detach();  // shares the input's version counter
    if (requires_grad[k]) {
      auto sink = std::make_shared<Capture>();
      sink->add(torch::autograd::InputMetadata(alias));
      torch::autograd::impl::set_gradient_edge(alias, torch::autograd::Edge(sink, 0));
      e.sinks[k] = std::move(sink);
    }
    e.input[k] = std::move(alias);
  }
  return e;
}

std::vector<const torch::autograd::Node*> nodes_of(
    const std::vector<std::shared_ptr<Capture>>& sinks) {
  std::vector<const torch::autograd::Node*> nodes;
  nodes.reserve(sinks.size());
  for (const auto& sink : sinks) nodes.push_back(sink.get());
  return nodes;
}

std::vector<bool> grad_flags(const Batch& batch) {
  std::vector<bool> flags;
  flags.reserve(batch.size());
  for (const auto& t : batch.values) flags.push_back(t.defined() && t.requires_grad());
  return flags;
}

// What leaves a stage: values without history, flagged as needing grad where
// the next stage must send one back.
Batch leave(const Batch& out, const std::vector<bool>& requires_grad) {
  Batch b;
  b.atomic = out.atomic;
  b.values.reserve(out.size());
  for (size_t k = 0; k < out.size(); ++k) {
    const auto& t = out[k];
    if (!t.defined()) {
      b.values.push_back(t);
      continue;
    }
    auto v = t.detach();
    if (requires_grad[k] && can_require_grad(v)) v.requires_grad_(true);
    b.values.push_back(std::move(v));
  }
  return b;
}

std::vector<int64_t> versions(const Batch& batch) {
  std::vector<int64_t> v;
  v.reserve(batch.size());
  for (const auto& t : batch.values) v.push_back(t.defined() ? t._version() : 0);
  return v;
}

// Whether two elements of `t` share memory (an expanded tensor). Dims by
// stride, smallest first: no two elements meet if each stride steps past
// everything the smaller strides reach.
bool elements_overlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the smaller strides reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += stride * (size - 1);
  }
  return false;
}

// Kernels choose their path, and so their order of summation, by where the
// data starts relative to this boundary too (a BLAS GEMM on a slice at an odd
// row gives other last bits than on an aligned copy of it).
constexpr int64_t kAlignment = 64;

// A copy of `t` (elements not overlapping) with its sizes and strides, whose
// first element lies as far past a kAlignment boundary as the original's.
at::Tensor aligned_alike(const at::Tensor& t) {
  const int64_t item = static_cast<int64_t>(t.element_size());
  int64_t span = 1;  // the elements the layout reaches
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  const auto misalign =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % kAlignment);
  if (t.numel() > 0 && misalign % item == 0) {
    at::Tensor buffer = at::empty({span + kAlignment / item}, t.options());
    const auto base =
        static_cast<int64_t>(reinterpret_cast<uintptr_t>(buffer.const_data_ptr()) % kAlignment);
    const int64_t shift = (misalign - base + kAlignment) % kAlignment;
    if (shift % item == 0) return buffer.as_strided(t.sizes(), t.strides(), shift / item);
  }
  return at::empty_strided(t.sizes(), t.strides(), t.options());
}

// A copy with the original's sizes and strides (a column slice stays a
// column slice) at the original's offset from a 64-byte boundary: kernels
// choose their order of summation from both (a matmul's backward does by the
// strides, a BLAS GEMM by the alignment), so a recompute from the copy
// computes bit for bit what the first forward computed from the original. A
// tensor whose elements overlap cannot be written through its own strides:
// it is cloned as torch clones it.
Batch cloned(const Batch& batch) {
  at::NoGradGuard no_grad;
  Batch b = batch;
  for (auto& t : b.values) {
    if (!t.defined()) continue;
    if (elements_overlap(t)) {
      t = t.clone();
      continue;
    }
    at::Tensor copy = aligned_alike(t);
    copy.copy_(t);
    t = std::move(copy);
  }
  return b;
}

// Runs the layers as one cell. Autocast keeps the casts of parameters in a
// per-thread cache until the outermost autocast region ends, which never
// happens on a worker: the cache would hand one cell's cast (and its graph
// node) to the next cell and to later steps, stale after an optimizer step.
// Each cell casts afresh instead.
Batch run_layers(Layers& layers, const Batch& input) {
  struct ClearCasts {
    ~ClearCasts() { at::autocast::clear_cache(); }
  } clear;
  try {
    return layers.forward(input);
  } catch (...) {
    // Before the caller lets go of its generator locks: a cell waiting for
    // them then finds the run failed (cancel.h).
    cancel_running();
    throw;
  }
}

// Holds the generator locks a cell needs: exclusive around a forward that may
// draw and must not be disturbed (and a recompute), shared around any other
// forward that may draw.
class RngLocks {
 public:
  void exclusive(GeneratorLock& lock) { unique_.emplace_back(lock); }
  void shared(GeneratorLock& lock) { shared_.emplace_back(lock); }

 private:
  std::vector<std::unique_lock<GeneratorLock>> unique_;
  std::vector<std::shared_lock<GeneratorLock>> shared_;
};

// How a cell's forward treats one of its stage's generators (see the table
// above Stage::forward).
enum class Draw : uint8_t { Free, Shared, Verify, Snapshot, Own };

// The live states of the generators a cell gave a stream of its own, put
// back however the cell ends (before its locks go: declared after them).
class LiveStates {
 public:
  explicit LiveStates(std::vector<at::Generator>& gens) : gens_(gens), live_(gens.size()) {}
  ~LiveStates() { restore(); }
  LiveStates(const LiveStates&) = delete;
  LiveStates& operator=(const LiveStates&) = delete;
  void save(size_t g) { live_[g] = get_state(gens_[g]); }
  void restore() {
    for (size_t g = 0; g < live_.size(); ++g) {
      if (live_[g].defined()) set_state(gens_[g], live_[g]);
      live_[g] = at::Tensor();
    }
  }

 private:
  std::vector<at::Generator>& gens_;
  std::vector<at::Tensor> live_;
};

}  // namespace

Stage::Stage(int64_t index, std::unique_ptr<Layers> layers, c10::Device device)
    : index_(index),
      layers_(std::move(layers)),
      lane_(make_lane(device)),
      generators_(generators_for(lane_.device)),
      shared_(generators_.size(), false) {
  TORCH_INTERNAL_ASSERT(generators_.size() <= draws_.size());
  for (const auto& g : generators_) generator_locks_.push_back(&lock_for(g));
}

void Stage::set_shared_generators(std::vector<bool> shared) {
  TORCH_INTERNAL_ASSERT(shared.size() == generators_.size());
  shared_ = std::move(shared);
}

void Stage::begin_step() {
  // "No" is kept while the layers' training flags and grad mode are those
  // of the step that learned it: a Dropout switched back to training is
  // relearned.
  std::vector<bool> flags = layers_->training_flags();
  flags.push_back(at::GradMode::is_enabled());
  const bool same_modes = flags == training_flags_;
  training_flags_ = std::move(flags);
  for (size_t g = 0; g < generators_.size(); ++g) {
    const bool drew = drew_[g].exchange(false);
    const bool quiet = same_modes && draws_[g].load() == kDrawsNot;
    draws_[g].store(drew ? kDraws : quiet ? kDrawsNot : kUnknown);
  }
}

// Random draws of a cell (RNG rule, rng.h), per generator g of the stage.
// `own`: the step gives cells streams of their own on g (the step has several
// micro-batches and other workers draw from g too). draws_[g] is what the
// stage's cells are known to do in this step, set at each step's start
// (begin_step): "yes" if a cell drew in the step before; "no" if the step
// before learned "no" and the layers' training flags and grad mode are as
// they were then; else unknown (relearned), so a model switched from eval
// to train is not taken for one that never draws. Learning costs a cell
// that runs alone (exclusive lock); relearning at every step ran every
// stage's first cell of every step alone, about K cells of each step in
// series.
//
//   case                          draws_[g]      lock        around the forward
//   own                           unknown, yes   exclusive   Own: g set to the cell's stream
//                                                            (cell_seed), the live state put
//                                                            back after; drew: the stream's
//                                                            start is the replay's state
//   own                           no             shared      Verify (below)
//   checkpointed, not own         unknown, yes   exclusive   Snapshot: drew: the live state
//                                                            before is the replay's state
//   checkpointed, not own         no             shared      Verify (below)
//   graph, run with checkpoints   -              shared      Shared: may draw, but not while a
//                                                            checkpointed cell snapshots
//   otherwise                     -              none        Free
//
// Own and Snapshot learn "draws" or "does not draw" where unknown. Verify
// checks the state after: unchanged, nothing to replay. Changed (this cell or
// a concurrent one drew): the snapshot may not be this cell's, so a
// checkpointed cell keeps the graph it built (no replay needed), and g
// becomes "yes". Where g is own, the draw came from the live generator in
// the threads' order: that step is not reproducible (warned once). Only a
// stage that draws nothing in a whole step (or in its first cell of a step)
// and then draws, its training flags unchanged, does that: a layer drawing
// on some steps or micro-batches only, by a flag of its own or its data.
//
// So every cell is exact, a layer may draw on some micro-batches only, a
// stage that never draws keeps full concurrency (after one exclusive cell in
// its first step and after each change of its training flags), and with own
// streams a cell's numbers depend on the seed, its stage and its micro-batch
// only: seeded runs are bitwise reproducible.
Batch Stage::forward(Cell& cell, const Batch& input, bool checkpoint, bool any_checkpoint,
                     const CellDraws& draws, bool share_captures) {
  const bool graph = at::GradMode::is_enabled();
  checkpoint = checkpoint && graph;
  const size_t gens = generators_.size();
  std::vector<Draw> how(gens, Draw::Free);
  for (size_t g = 0; g < gens; ++g) {
    const bool own = draws.step_seed.has_value() && shared_[g];
    const bool drawless = draws_[g].load() == kDrawsNot;
    if (own) {
      how[g] = drawless ? Draw::Verify : Draw::Own;
    } else if (checkpoint) {
      how[g] = drawless ? Draw::Verify : Draw::Snapshot;
    } else if (graph && any_checkpoint) {
      how[g] = Draw::Shared;
    }
  }

  RngLocks locks;
  for (size_t g = 0; g < gens; ++g) {
    if (how[g] == Draw::Shared || how[g] == Draw::Verify) locks.shared(*generator_locks_[g]);
    if (how[g] == Draw::Snapshot || how[g] == Draw::Own) locks.exclusive(*generator_locks_[g]);
  }
  // A cell may have failed while this one waited for the locks.
  stop_if_cancelled();
  LiveStates live(generators_);
  // `mark`: tells after the forward whether g drew; `before`: the state a
  // replay starts from, taken only where a checkpointed cell may need it.
  std::vector<at::Tensor> before(gens);
  std::array<std::optional<DrawMark>, 2> mark;
  for (size_t g = 0; g < gens; ++g) {
    switch (how[g]) {
      case Draw::Free:
      case Draw::Shared:
        break;
      case Draw::Verify:
        mark[g].emplace(generators_[g]);
        break;
      case Draw::Snapshot:
        before[g] = get_state(generators_[g]);
        mark[g].emplace(generators_[g]);
        break;
      case Draw::Own:
        live.save(g);
        reseed(generators_[g], cell_seed(*draws.step_seed, index_, draws.microbatch, g));
        if (checkpoint) before[g] = get_state(generators_[g]);
        mark[g].emplace(generators_[g]);
        break;
    }
  }
  // After the forward: learns what the cell drew, keeps the states a replay
  // needs (checkpointed), and puts the live states back. False when a
  // checkpointed cell drew what no snapshot covers.
  auto settle_draws = [&] {
    bool replayable = true;
    if (checkpoint) cell.rng_before.assign(gens, at::Tensor());
    for (size_t g = 0; g < gens; ++g) {
      if (how[g] == Draw::Free || how[g] == Draw::Shared) continue;
      const bool drew = !(*mark[g] == DrawMark(generators_[g]));
      if (drew) drew_[g].store(true);
      if (how[g] == Draw::Verify) {
        if (!drew) continue;
        replayable = false;
        draws_[g].store(kDraws);
        if (draws.step_seed) {
          TORCH_WARN_ONCE("gpipe: stage ", index_, " drew random numbers on micro-batch ",
                          draws.microbatch, " although its first micro-batch of this step drew "
                          "none; those draws followed the threads' timing, so this step is not "
                          "bitwise reproducible (the next steps are while the stage draws)");
        }
        continue;
      }
      if (drew && checkpoint) cell.rng_before[g] = std::move(before[g]);
      int unknown = kUnknown;
      draws_[g].compare_exchange_strong(unknown, drew ? kDraws : kDrawsNot);
    }
    live.restore();
    return replayable;
  };

  if (!graph) {
    // Inference: no graph, nothing kept.
    Batch out = run_layers(*layers_, input);
    settle_draws();
    return out;
  }
  cell.input_atomic = input.atomic;
  const auto flags = grad_flags(input);
  bool saved_copy = false;
  if (checkpoint) {
    cell.saved_requires_grad = flags;
    saved_copy = mutates_input_.load() != kKeeps;
    cell.saved = saved_copy ? cloned(input) : input;
  }

  const auto versions_before = versions(input);
  // The graph is built also for a checkpointed cell: it tells which outputs
  // need grad and which outside tensors the cell reaches, as the plain
  // model's graph would. It is dropped at the end of this call, so memory
  // peaks at one micro-batch's activations, as in its recompute.
  GraphWindow window;
  auto entry = enter(input, flags);
  Batch out;
  {
    RunningGuard running(checkpoint ? Running::Checkpointing : Running::Plain);
    out = run_layers(*layers_, entry.input);
  }
  window.close();
  const bool replayable = settle_draws();
  cell.share_captures = share_captures;
  cell.cut = cut_at_externals(out.values, window, nodes_of(entry.sinks), share_captures);
  Batch leaving = leave(out, grad_flags(out));
  const bool mutated = versions(input) != versions_before;
  int expected = kUnknown;
  const bool learned = mutates_input_.compare_exchange_strong(expected, mutated ? kMutates : kKeeps);
  cell.input_watch.clear();
  auto keep_graph = [&] {
    cell.checkpointed = false;
    cell.saved = Batch();
    cell.saved_requires_grad.clear();
    cell.rng_before.clear();
    cell.outputs = std::move(out);
    cell.input_sinks = std::move(entry.sinks);
    return std::move(leaving);
  };
  if (!checkpoint) return keep_graph();

  if (!learned) {
    TORCH_CHECK(!(expected == kKeeps && mutated), "stage ", index_,
                " modified its input in place although it did not on earlier micro-batches, so "
                "its checkpoint holds no copy to recompute from; use Checkpoint::Never for this "
                "model, or make the in-place layer unconditional");
  }
  if (!replayable) return keep_graph();

  cell.checkpointed = true;
  // An output that is the input (or a view of it) hands the input on: the
  // next stage may change it in place, which the plain model allows unless
  // it saved the input. Recompute from a copy then.
  bool aliased = false;
  for (const auto& o : leaving.values) {
    for (const auto& t : input.values) aliased |= o.defined() && t.defined() && o.is_alias_of(t);
  }
  if (aliased) {
    if (!saved_copy) cell.saved = cloned(input);
    return leaving;
  }
  // Otherwise watch the input as handed in for in-place changes before the
  // backward, as autograd watches what the plain model saved (even where the
  // first cell saved a copy: the plain model would not have). A stage that
  // changes its input itself recomputes from a copy and needs no watch.
  if (!mutated) cell.input_watch.watch(input);
  // The cell that learned "keeps" saved a copy in case it did not: recompute
  // from the input itself, as every later cell does. A GEMM need not give the
  // same bits on a copy (this CPU's BLAS takes another path for data at
  // another alignment: a slice of a larger batch), so recomputing from the
  // copy made the first step's recomputes differ from their forwards in the
  // last bits, and its grads from later steps'.
  if (learned && !mutated) cell.saved = input;
  return leaving;  // `out` and `entry` go: the graph is freed here
}

void VersionWatch::watch(const Batch& batch) {
  for (const auto& t : batch.values) {
    if (!t.defined()) continue;
    counters_.push_back(t.unsafeGetTensorImpl()->version_counter());
    versions_.push_back(counters_.back().current_version());
  }
}

void VersionWatch::clear() {
  counters_.clear();
  versions_.clear();
}

void VersionWatch::check(const std::string& what) const {
  for (size_t k = 0; k < counters_.size(); ++k) {
    const uint32_t now = counters_[k].current_version();
    TORCH_CHECK(now == versions_[k],
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: ", what, " is at version ", now, "; expected version ",
                versions_[k],
                " instead. Don't change the Pipe's input in place between forward and backward");
  }
}

void Stage::recompute(Cell& cell, const at::ThreadLocalState& forward_state) {
  cell.input_watch.check("the input of stage " + std::to_string(index_));
  RngLocks locks;
  std::vector<at::Tensor> live(generators_.size());
  for (size_t g = 0; g < generators_.size(); ++g) {
    if (g >= cell.rng_before.size() || !cell.rng_before[g].defined()) continue;
    locks.exclusive(*generator_locks_[g]);
  }
  stop_if_cancelled();  // as in forward
  for (size_t g = 0; g < generators_.size(); ++g) {
    if (g >= cell.rng_before.size() || !cell.rng_before[g].defined()) continue;
    live[g] = get_state(generators_[g]);
    set_state(generators_[g], cell.rng_before[g]);
  }
  // Put the live generator states back however the recompute ends.
  struct Restore {
    std::vector<at::Generator>& gens;
    std::vector<at::Tensor>& live;
    ~Restore() {
      for (size_t g = 0; g < gens.size(); ++g) {
        if (live[g].defined()) set_state(gens[g], live[g]);
      }
    }
  } restore{generators_, live};

  at::ThreadLocalStateGuard first_forward(forward_state);
  at::AutoGradMode grad(true);  // backward runs with grad mode off
  // A layer that works in place would spoil the saved input for a second
  // backward (retain_graph): give it a copy.
  const Batch& source = cell.saved;
  GraphWindow window;
  auto entry = enter(mutates_input_.load() == kMutates ? cloned(source) : source,
                     cell.saved_requires_grad);
  {
    RunningGuard running(Running::Recomputing);
    cell.outputs = run_layers(*layers_, entry.input);
  }
  window.close();
  cell.input_sinks = std::move(entry.sinks);
  cell.cut = cut_at_externals(cell.outputs.values, window, nodes_of(cell.input_sinks),
                              cell.share_captures);
}

namespace {

// Points each capture node of `cut` at its sink for the duration of one
// backward pass, and back at nothing afterwards.
class ArmedCaptures {
 public:
  ArmedCaptures(const Cut& cut, const std::vector<ExternalSink>& sinks,
                std::vector<at::Tensor>& external_grads)
      : cut_(cut) {
    for (size_t e = 0; e < cut.externals.size(); ++e) {
      const auto& node = cut.capture_nodes[e];
      // Not wanted: nothing goes there (a shared node runs for its other
      // inputs' sake, and would otherwise hand this one's grad on).
      if (!node || !sinks[e].wanted) continue;
      auto& sink = node->sinks[cut.captures[e].input_nr];
      sink.into = &external_grads[e];
      sink.accumulate = sinks[e].accumulate;
      sink.slot = sinks[e].slot;
    }
  }
  ~ArmedCaptures() {
    for (const auto& node : cut_.capture_nodes) {
      if (node) std::fill(node->sinks.begin(), node->sinks.end(), Capture::Sink{});
    }
  }
  ArmedCaptures(const ArmedCaptures&) = delete;
  ArmedCaptures& operator=(const ArmedCaptures&) = delete;

 private:
  const Cut& cut_;
};

// For one backward that wants some of a shared capture node's edges and not
// others: autograd marks nodes, not their inputs, as needed for a target, so
// targeting the node would also run the nodes on the paths to its unwanted
// inputs (layers' backwards the plain model skips: they may raise or fire
// hooks). Points each unwanted edge of such a node at a node of its own,
// which no target needs, for the run, and back afterwards.
class Unshared {
 public:
  Unshared(const Cut& cut, const std::vector<ExternalSink>& sinks) : cut_(cut) {
    std::vector<const Capture*> wanted_nodes;
    for (size_t e = 0; e < cut.externals.size(); ++e) {
      if (cut.capture_nodes[e] && sinks[e].wanted) wanted_nodes.push_back(cut.capture_nodes[e].get());
    }
    for (size_t e = 0; e < cut.externals.size(); ++e) {
      const auto& node = cut.capture_nodes[e];
      if (!node || sinks[e].wanted || node->num_inputs() < 2) continue;
      if (std::find(wanted_nodes.begin(), wanted_nodes.end(), node.get()) == wanted_nodes.end()) {
        continue;  // nothing on this node is wanted: not a target, not run
      }
      auto aside = std::make_shared<Capture>();
      const uint32_t input = aside->add(node->input_metadata(cut.captures[e].input_nr));
      for (const auto& [producer, i] : cut.producers[e]) {
        producer->next_edges()[i] = torch::autograd::Edge(aside, input);
        moved_.push_back({producer, i, e});
      }
      asides_.push_back(std::move(aside));
    }
  }
  ~Unshared() {
    for (const auto& m : moved_) m.producer->next_edges()[m.output] = cut_.captures[m.external];
  }
  Unshared(const Unshared&) = delete;
  Unshared& operator=(const Unshared&) = delete;

 private:
  struct Moved {
    torch::autograd::Node* producer;
    uint32_t output;
    size_t external;
  };
  const Cut& cut_;
  std::vector<Moved> moved_;
  std::vector<std::shared_ptr<Capture>> asides_;
};

// Points the sinks of the wanted inputs at their slots in `grads` for one
// backward pass (a grad reaching any other sink is dropped), and back at
// nothing afterwards; adds those sinks to `targets`.
class ArmedInputs {
 public:
  ArmedInputs(const std::vector<std::shared_ptr<Capture>>& sinks, const std::vector<bool>& wanted,
              std::vector<at::Tensor>& grads, torch::autograd::edge_list& targets)
      : sinks_(sinks) {
    grads.assign(sinks.size(), at::Tensor());
    for (size_t k = 0; k < sinks.size(); ++k) {
      if (!sinks[k] || k >= wanted.size() || !wanted[k]) continue;
      sinks[k]->sinks[0].into = &grads[k];
      targets.emplace_back(sinks[k], 0);
    }
  }
  ~ArmedInputs() {
    for (const auto& sink : sinks_) {
      if (sink) sink->sinks[0] = Capture::Sink{};
    }
  }
  ArmedInputs(const ArmedInputs&) = delete;
  ArmedInputs& operator=(const ArmedInputs&) = delete;

 private:
  const std::vector<std::shared_ptr<Capture>>& sinks_;
};

// The layers returned an outside tensor itself as output k: its grad is
// `grad`, straight into the sink.
void deliver_direct(int64_t direct, const at::Tensor& grad, const std::vector<ExternalSink>& sinks,
                    std::vector<at::Tensor>& external_grads) {
  const auto& sink = sinks[static_cast<size_t>(direct)];
  if (!sink.wanted) return;
  if (sink.accumulate != nullptr) {
    accumulate_into(*sink.accumulate, *sink.slot, grad);
  } else {
    auto& g = external_grads[static_cast<size_t>(direct)];
    g = g.defined() ? g + grad : grad;
  }
}

// `every_sink`: the targets are every input sink and capture node the
// roots reach (the cut leaves no other way out of the cell), so the walk
// needs no pruning to them: autograd then skips building its per-call map
// of the nodes on a path to a target (GraphTask::init_to_execute), a cost
// per cell that the plain model pays once per backward.
void run_backward(const torch::autograd::edge_list& roots, const variable_list& grads,
                  bool keep_graph, const torch::autograd::edge_list& targets, bool every_sink) {
  if (roots.empty() || targets.empty()) return;
  // accumulate_grad: the targets run (input sinks, capture nodes)
  // rather than being captured; nothing else outside the cell is reached.
  torch::autograd::Engine::get_default_engine().execute(
      roots, grads, keep_graph, /*create_graph=*/false, /*accumulate_grad=*/true,
      every_sink ? torch::autograd::edge_list() : targets);
}

}  // namespace

Batch Stage::backward(Cell& cell, const Batch& grads, bool keep_graph,
                      const std::vector<bool>& wanted_inputs,
                      const std::vector<ExternalSink>& sinks,
                      std::vector<at::Tensor>& external_grads) {
  TORCH_CHECK(grads.size() == cell.outputs.size(), "stage ", index_, " produced ",
              cell.outputs.size(), " outputs but received ", grads.size(), " grads");
  const Cut& cut = cell.cut;
  TORCH_INTERNAL_ASSERT(sinks.size() == cut.externals.size());
  external_grads.assign(cut.externals.size(), at::Tensor());
  torch::autograd::edge_list roots;
  variable_list root_grads;
  for (size_t k = 0; k < cell.outputs.size(); ++k) {
    const auto& out = cell.outputs[k];
    if (!out.defined() || !out.requires_grad() || !grads[k].defined()) continue;
    if (cut.direct[k] >= 0) {
      deliver_direct(cut.direct[k], grads[k], sinks, external_grads);
      continue;
    }
    roots.push_back(torch::autograd::impl::gradient_edge(out));
    root_grads.push_back(grads[k]);
  }
  // The grads leave the cell at the sinks of its wanted inputs (into
  // `result`) and at the capture nodes of the external edges asked for,
  // which add them into .grad or into a sum as they arrive, so a
  // parameter's grad lives no longer than in the plain model's backward.
  Batch result;
  result.atomic = cell.input_atomic;
  {
    torch::autograd::edge_list targets;
    ArmedInputs inputs(cell.input_sinks, wanted_inputs, result.values, targets);
    bool every_sink = true;
    for (size_t k = 0; k < cell.input_sinks.size(); ++k) {
      const bool wanted = k < wanted_inputs.size() && wanted_inputs[k];
      if (cell.input_sinks[k] && !wanted) every_sink = every_sink && !cut.reached[k];
    }
    for (size_t e = 0; e < cut.externals.size(); ++e) {
      if (!cut.capture_nodes[e]) continue;
      if (sinks[e].wanted) {
        targets.push_back(cut.captures[e]);
      } else {
        every_sink = false;
      }
    }
    ArmedCaptures armed(cut, sinks, external_grads);
    std::optional<Unshared> unshared;
    if (!every_sink) unshared.emplace(cut, sinks);
    run_backward(roots, root_grads, keep_graph, targets, every_sink);
  }
  if (cell.checkpointed) {
    // The recomputed graph is spent either way; the checkpoint stays for
    // another backward only when asked to.
    cell.outputs = Batch();
    cell.input_sinks.clear();
    if (!keep_graph) cell = Cell();
  } else if (!keep_graph) {
    cell = Cell();
  }
  return result;
}

Batch Stage::backward_input(Cell& cell, const Batch& grads, const std::vector<bool>& wanted_inputs,
                            const std::vector<ExternalSink>& sinks,
                            std::vector<at::Tensor>& external_grads) {
  TORCH_CHECK(grads.size() == cell.outputs.size(), "stage ", index_, " produced ",
              cell.outputs.size(), " outputs but received ", grads.size(), " grads");
  external_grads.assign(cell.cut.externals.size(), at::Tensor());
  // Only the wanted inputs' sinks count: a path to any other is W's.
  const size_t values = cell.input_sinks.size();
  std::vector<const torch::autograd::Node*> inputs(values);
  bool any_input = false;
  for (size_t k = 0; k < values; ++k) {
    if (cell.input_sinks[k] && k < wanted_inputs.size() && wanted_inputs[k]) {
      inputs[k] = cell.input_sinks[k].get();
      any_input = true;
    }
  }
  Batch none(std::vector<at::Tensor>(values), cell.input_atomic);
  if (!any_input) {
    // Nothing to pass back (the first stage): all of it is W's.
    cell.deferred = Cell::Deferred::Whole;
    cell.output_grads = grads;
    return none;
  }
  auto split = std::make_shared<WeightSplit>(split_weights(cell.outputs.values, inputs, cell.cut));
  if (!split->splittable) {
    Batch dx = backward(cell, grads, /*keep_graph=*/false, wanted_inputs, sinks, external_grads);
    cell.deferred = Cell::Deferred::Nothing;
    return dx;
  }
  torch::autograd::edge_list roots;
  variable_list root_grads;
  for (size_t k = 0; k < cell.outputs.size(); ++k) {
    const auto& out = cell.outputs[k];
    if (!out.defined() || !out.requires_grad() || !grads[k].defined()) continue;
    if (cell.cut.direct[k] >= 0) continue;  // W's
    roots.push_back(torch::autograd::impl::gradient_edge(out));
    root_grads.push_back(grads[k]);
  }
  Batch result = none;
  {
    torch::autograd::edge_list targets;
    ArmedInputs armed_inputs(cell.input_sinks, wanted_inputs, result.values, targets);
    struct Arm {
      WeightSplit& split;
      explicit Arm(WeightSplit& s) : split(s) {
        for (auto& r : split.roots) {
          if (r.caught) r.caught->armed = true;
        }
      }
      ~Arm() {
        for (auto& r : split.roots) {
          if (r.caught) r.caught->armed = false;
        }
      }
    } arm(*split);
    run_backward(roots, root_grads, /*keep_graph=*/true, targets, /*every_sink=*/false);
  }
  cell.deferred = Cell::Deferred::Split;
  cell.output_grads = grads;
  cell.split = std::move(split);
  return result;
}

void Stage::backward_weight(Cell& cell, const std::vector<ExternalSink>& sinks,
                            std::vector<at::Tensor>& external_grads) {
  const Cut& cut = cell.cut;
  external_grads.assign(cut.externals.size(), at::Tensor());
  switch (cell.deferred) {
    case Cell::Deferred::Nothing:
      cell = Cell();
      return;
    case Cell::Deferred::Whole: {
      const Batch grads = std::move(cell.output_grads);
      backward(cell, grads, /*keep_graph=*/false, std::vector<bool>(cell.input_sinks.size(), false),
               sinks, external_grads);
      cell = Cell();
      return;
    }
    case Cell::Deferred::Split:
      break;
  }
  TORCH_INTERNAL_ASSERT(sinks.size() == cut.externals.size());
  const Batch& grads = cell.output_grads;
  {
    ArmedCaptures armed(cut, sinks, external_grads);
    for (size_t k = 0; k < cell.outputs.size(); ++k) {
      const auto& out = cell.outputs[k];
      if (out.defined() && out.requires_grad() && grads[k].defined() && cut.direct[k] >= 0) {
        deliver_direct(cut.direct[k], grads[k], sinks, external_grads);
      }
    }
    for (const auto& root : cell.split->roots) {
      torch::autograd::edge_list roots;
      variable_list root_grads;
      if (root.node) {
        const auto& caught = root.caught->grads;
        for (size_t slot = 0; slot < caught.size(); ++slot) {
          if (!caught[slot].defined()) continue;
          roots.emplace_back(root.node, static_cast<uint32_t>(slot));
          root_grads.push_back(caught[slot]);
        }
      } else {
        const auto k = static_cast<size_t>(root.output);
        if (!grads[k].defined()) continue;
        roots.push_back(torch::autograd::impl::gradient_edge(cell.outputs[k]));
        root_grads.push_back(grads[k]);
      }
      torch::autograd::edge_list targets;
      for (size_t e : root.targets) {
        if (sinks[e].wanted) targets.push_back(cut.captures[e]);
      }
      // The graph stays for the other roots; it goes with the cell below.
      run_backward(roots, root_grads, /*keep_graph=*/true, targets, /*every_sink=*/false);
    }
  }
  cell = Cell();
}

}  // namespace gpipe::detail
