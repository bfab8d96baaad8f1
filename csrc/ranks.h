// ranks.h — what the ranks of a pipeline must share: the settings they agree on, and the parameters tied across them.
//
// Every rank builds the same model and wraps it with the same settings; each
// then keeps only its stages. A rank that differs (another balance, schedule
// or chunk count, a layer of another shape) would train another model or
// wait forever for a hand-off no one sends, so the pipe compares every
// rank's settings once, at construction, and all ranks refuse together.
//
// A parameter that layers on several ranks use (a GPT's token embedding and
// its tied lm_head) has one replica on each of those ranks, the owners, as
// in Megatron-LM. The replicas start as the lowest owner's, and after each
// training step every replica's `.grad` is the sum of the grads of all its
// uses, so that any deterministic optimizer keeps them equal:
//
//   rank 0 (emb)     rank 1      rank 2      rank 3 (head)
//   grad g0                                  grad g3
//      \___________ all_reduce(SUM) over the owners ___________/
//   grad g0 + g3                              grad g0 + g3
//
// The sum runs over the owners' own group where the caller made one (Python
// makes it with new_group: Tie::owners_only), else over the pipeline group,
// in which ranks without a use add zeros (C++: c10d has no portable way to
// make a group).
// With data parallelism it runs after the step's averaging over the
// replicas; both are sums, so the result is the same.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace gpipe::detail {

/// One setting every rank must share: its name and its value as text.
struct Setting {
  std::string name;
  std::string value;
};

/// Gathers every rank's `settings` over `group` (two all_reduces of int32
/// tensors on `device`) and, where any two ranks differ, throws a ValueError
/// on every rank naming each setting they disagree on and which ranks hold
/// which value. `what` names the pipe in the message.
void check_agreement(c10d::ProcessGroup& group, c10::Device device,
                     const std::vector<Setting>& settings, const std::string& what);

/// What a rank brings to a step over a group, exchanged before anything is
/// sent, so that an argument error on one rank stops every rank cleanly.
struct StepStart {
  /// This rank's argument error (its first line); empty: none.
  std::string error;
  /// On the first stage's rank: the input micro-batches' rows along the
  /// batch dim (empty: not cut, or not this rank). At most `chunks`.
  std::vector<int64_t> input_rows;
  /// On the last stage's rank: the target micro-batches' rows.
  std::vector<int64_t> target_rows;
};

/// Every rank's StepStart, indexed by rank: one all_reduce of a small int64
/// table over `group` (on `device`), and two more (the texts) only when some
/// rank has an error. A rank still missing after `timeout` (nonzero) fails
/// the exchange, naming the step timeout.
std::vector<StepStart> exchange_step_start(
    c10d::ProcessGroup& group, c10::Device device, const StepStart& mine, int64_t chunks,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

/// The layers' parameters, as every rank sees them in its whole model: per
/// layer, its parameters by name ("weight") with the tensor.
using LayerParameters = std::vector<std::vector<std::pair<std::string, at::Tensor>>>;

/// Settings naming each layer's parameters ("layer 3": "weight [16, 8]
/// Double, bias [16] Double"; "none" for a layer without), for
/// check_agreement. Classes are not compared: a rank may wrap a layer
/// (to inject a fault, say) as long as its parameters are the same.
std::vector<Setting> parameter_settings(const LayerParameters& layers);

/// A parameter that layers on several ranks use.
struct Tie {
  /// Its uses in layer order ("0.weight", "5.weight").
  std::vector<std::string> uses;
  /// The pipeline ranks holding a use, ascending.
  std::vector<int64_t> owners;
  /// This rank's replica; undefined on a rank that holds no use.
  at::Tensor replica;
  /// Its sizes, dtype and whether it requires grad (every rank knows them:
  /// every rank built the whole model).
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
  /// Whether only the owners take part, over `group` (their own group, set
  /// on the owners); else every rank does, over the pipeline group, ranks
  /// without a use adding zeros.
  bool owners_only = false;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

/// The ties among `layers` (as in parameter_settings) whose uses fall on
/// two or more ranks: `rank_of_layer[k]` is layer k's pipeline rank,
/// `names[k]` its name in the Sequential. Replicas are set on `rank`'s
/// owners; every rank takes part in the sums (no owners' group).
std::vector<Tie> find_ties(const LayerParameters& layers, const std::vector<std::string>& names,
                           const std::vector<int64_t>& rank_of_layer, int64_t rank);

/// One setting listing the ties, for check_agreement ("tied parameters").
Setting ties_setting(const std::vector<Tie>& ties);

/// This rank's part in its ties: replicas made equal, grads summed.
class TiedParameters {
 public:
  /// `pipeline`: the pipeline group (for ties without a group of their
  /// own); `wire`: where the all_reduces' tensors live (the CPU over Gloo).
  TiedParameters(std::vector<Tie> ties, c10d::ProcessGroup& pipeline, c10::Device wire);

  /// Sets every replica to the lowest owner's values. Every rank of each
  /// tie's group calls it (construction).
  void broadcast();
  /// Before a training step: puts each replica's `.grad` aside, so that
  /// the step's own grads are what reduce_grads sums (grads accumulate
  /// over steps; summing the accumulated ones would count earlier steps'
  /// again).
  void begin_step();
  /// After a training step: every replica's `.grad` becomes what was put
  /// aside plus the sum over the owners of this step's grads (a replica
  /// without a grad counts as zeros). Every rank of each tie's group calls it.
  void reduce_grads();
  /// After a failed step: the put-aside grads back, plus whatever the step
  /// added here.
  void restore_grads();

  /// Replaces the replicas, one tensor per tie in order (undefined: keep
  /// the one there), each of the tie's sizes, on a rank that holds one. Its
  /// `.grad` is what later steps sum: FSDP2 swaps a parameter for its
  /// shards and accumulates a step's grads on an unsharded copy, which is
  /// the replica to sum before FSDP2 reduce-scatters it.
  void set_replicas(const std::vector<at::Tensor>& replicas);

  bool empty() const noexcept { return ties_.empty(); }

 private:
  /// The sum over the tie's group of each member's `mine` (undefined: zeros),
  /// on the wire device.
  at::Tensor sum(const Tie& tie, const at::Tensor& mine);

  std::vector<Tie> ties_;
  /// Per tie, its replica's `.grad` before the step (begin_step).
  std::vector<at::Tensor> aside_;
  c10d::ProcessGroup& pipeline_;
  c10::Device wire_;
  int64_t rank_;
};

}  // namespace gpipe::detail
