// stage.cpp — a cell's forward (plain or checkpointed), its exact recompute, and its backward.
#include "stage.h"

#include "phase.h"
#include "rng.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <shared_mutex>

namespace gpipe::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kUnknown = 0;
constexpr int kMutates = 1;
constexpr int kKeeps = 2;

// The stage-boundary identity. A stage's first layer may modify its input in
// place (ReLU(inplace=true)); autograd refuses that on a leaf requiring grad,
// yet the leaf is where the input's grad lands. So the layers get this node's
// outputs instead: non-leaf aliases of the leaves.
//
//   leaf (requires grad, .grad = input grad) <- Boundary <- layers (may work in place)
struct Boundary : torch::autograd::Function<Boundary> {
  static variable_list forward(AutogradContext* /*ctx*/, at::TensorList xs) {
    variable_list out;
    out.reserve(xs.size());
    for (const auto& x : xs) out.push_back(x.detach());
    return out;
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return grads; }
};

bool can_require_grad(const at::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

// The layers' input for a graph-building forward, and the leaves whose grads
// are the input grads.
struct Entry {
  Batch input;
  std::vector<at::Tensor> leaves;
};

Entry enter(const Batch& input, const std::vector<bool>& requires_grad) {
  Entry e{input, std::vector<at::Tensor>(input.size())};
  variable_list leaves;
  std::vector<size_t> where;
  for (size_t k = 0; k < input.size(); ++k) {
    if (!input[k].defined()) continue;
    if (requires_grad[k]) {
      e.leaves[k] = input[k].detach().requires_grad_(true);
      leaves.push_back(e.leaves[k]);
      where.push_back(k);
    } else {
      e.input[k] = input[k].detach();
    }
  }
  if (!leaves.empty()) {
    // A TensorList, not a vector: apply() only sees tensors it can iterate.
    auto aliases = Boundary::apply(at::TensorList(leaves));
    for (size_t m = 0; m < where.size(); ++m) e.input[where[m]] = aliases[m];
  }
  return e;
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

Batch cloned(const Batch& batch) {
  at::NoGradGuard no_grad;
  Batch b = batch;
  for (auto& t : b.values) {
    if (t.defined()) t = t.clone();
  }
  return b;
}

// Holds the generator locks a cell needs: exclusive around a checkpointed
// forward and a recompute, shared around any other forward that may draw.
class RngLocks {
 public:
  void exclusive(const at::Generator& g) { unique_.emplace_back(lock_for(g)); }
  void shared(const at::Generator& g) { shared_.emplace_back(lock_for(g)); }

 private:
  std::vector<std::unique_lock<std::shared_mutex>> unique_;
  std::vector<std::shared_lock<std::shared_mutex>> shared_;
};

}  // namespace

Stage::Stage(int64_t index, std::unique_ptr<Layers> layers, c10::Device device)
    : index_(index),
      layers_(std::move(layers)),
      lane_(make_lane(device)),
      generators_(generators_for(lane_.device)) {}

Batch Stage::forward(Cell& cell, StageRun& run, const Batch& input, bool checkpoint) {
  if (!at::GradMode::is_enabled()) {
    // Inference: no graph, nothing kept.
    return layers_->forward(input);
  }
  if (run.draws.empty()) run.draws.assign(generators_.size(), Draws::Unknown);
  cell.input_atomic = input.atomic;

  if (!checkpoint) {
    RngLocks locks;
    if (run.any_checkpoint) {
      for (size_t g = 0; g < generators_.size(); ++g) {
        if (run.draws[g] != Draws::No) locks.shared(generators_[g]);
      }
    }
    auto entry = enter(input, grad_flags(input));
    cell.outputs = layers_->forward(entry.input);
    cell.leaves = std::move(entry.leaves);
    return leave(cell.outputs, grad_flags(cell.outputs));
  }

  // Checkpointed: run without a graph, keep the input and the generator
  // states to replay this exact forward just before the backward.
  cell.checkpointed = true;
  cell.saved_requires_grad = grad_flags(input);
  cell.saved = mutates_input_.load() == kKeeps ? input : cloned(input);
  cell.rng_before.assign(generators_.size(), at::Tensor());

  RngLocks locks;
  for (size_t g = 0; g < generators_.size(); ++g) {
    if (run.draws[g] == Draws::No) continue;
    locks.exclusive(generators_[g]);
    cell.rng_before[g] = get_state(generators_[g]);
  }

  Batch plain = input;
  for (auto& t : plain.values) {
    if (t.defined()) t = t.detach();
  }
  const auto before = versions(plain);
  Batch out;
  {
    at::NoGradGuard no_grad;
    RunningGuard running(Running::Checkpointing);
    out = layers_->forward(plain);
  }

  const bool mutated = versions(plain) != before;
  int expected = kUnknown;
  if (!mutates_input_.compare_exchange_strong(expected, mutated ? kMutates : kKeeps)) {
    TORCH_CHECK(!(expected == kKeeps && mutated), "stage ", index_,
                " modified its input in place although it did not on earlier micro-batches, so "
                "its checkpoint holds no copy to recompute from; use Checkpoint::Never for this "
                "model, or make the in-place layer unconditional");
  }
  for (size_t g = 0; g < generators_.size(); ++g) {
    if (run.draws[g] != Draws::Unknown) continue;
    const bool same = same_state(cell.rng_before[g], get_state(generators_[g]));
    run.draws[g] = same ? Draws::No : Draws::Yes;
    if (same) cell.rng_before[g] = at::Tensor();
  }

  // The outputs need grad if anything they come from does; recompute finds
  // out exactly, a spare flag only costs an unused grad.
  bool any = layers_->requires_grad();
  for (bool f : cell.saved_requires_grad) any = any || f;
  return leave(out, std::vector<bool>(out.size(), any));
}

void Stage::recompute(Cell& cell, const at::ThreadLocalState& forward_state) {
  RngLocks locks;
  std::vector<at::Tensor> live(generators_.size());
  for (size_t g = 0; g < generators_.size(); ++g) {
    if (!cell.rng_before[g].defined()) continue;
    locks.exclusive(generators_[g]);
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
  auto entry = enter(mutates_input_.load() == kMutates ? cloned(source) : source,
                     cell.saved_requires_grad);
  RunningGuard running(Running::Recomputing);
  cell.outputs = layers_->forward(entry.input);
  cell.leaves = std::move(entry.leaves);
}

Batch Stage::backward(Cell& cell, const Batch& grads, bool keep_graph) {
  TORCH_CHECK(grads.size() == cell.outputs.size(), "stage ", index_, " produced ",
              cell.outputs.size(), " outputs but received ", grads.size(), " grads");
  variable_list roots;
  variable_list root_grads;
  for (size_t k = 0; k < cell.outputs.size(); ++k) {
    const auto& out = cell.outputs[k];
    if (out.defined() && out.requires_grad() && grads[k].defined()) {
      roots.push_back(out);
      root_grads.push_back(grads[k]);
    }
  }
  for (auto& leaf : cell.leaves) {
    if (leaf.defined()) leaf.mutable_grad().reset();
  }
  if (!roots.empty()) {
    torch::autograd::backward(roots, root_grads, /*retain_graph=*/keep_graph,
                              /*create_graph=*/false);
  }
  Batch result;
  result.atomic = cell.input_atomic;
  result.values.reserve(cell.leaves.size());
  for (auto& leaf : cell.leaves) result.values.push_back(leaf.defined() ? leaf.grad() : at::Tensor());

  if (cell.checkpointed) {
    // The recomputed graph is spent either way; the checkpoint stays for
    // another backward only when asked to.
    cell.outputs = Batch();
    cell.leaves.clear();
    if (!keep_graph) cell = Cell();
  } else if (!keep_graph) {
    cell = Cell();
  }
  return result;
}

}  // namespace gpipe::detail

