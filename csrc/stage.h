// stage.h — one stage: its layers on one device, running a micro-batch forward, recompute and backward.
#pragma once

#include "microbatch.h"
#include "streams.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace gpipe::detail {

/// The layers of one stage, callable on a batch. The C++ Pipe runs
/// `torch::nn::AnyModule`s; the Python package runs Python modules.
class Layers {
 public:
  virtual ~Layers() = default;
  /// Runs the layers in order on `input` (already on the stage's device).
  virtual Batch forward(const Batch& input) = 0;
  /// Whether any parameter of these layers requires grad.
  virtual bool requires_grad() const = 0;
};

/// What one (stage, micro-batch) cell keeps between its forward and its
/// backward.
struct Cell {
  bool checkpointed = false;
  /// Whether the input was one tensor (the grads going back take its shape).
  bool input_atomic = true;
  /// Checkpointed: the stage input to recompute from, and its grad flags.
  Batch saved;
  std::vector<bool> saved_requires_grad;
  /// Checkpointed: the state of each of the stage's generators before the
  /// first forward (undefined where the stage does not draw from it).
  std::vector<at::Tensor> rng_before;
  /// Stage-local graph: leaves standing for the inputs (undefined where an
  /// input needs no grad) and the outputs it ends in.
  std::vector<at::Tensor> leaves;
  Batch outputs;
};

/// Per call and stage: whether the stage draws from each of its generators.
/// Learned on the stage's first checkpointed cell of the call, while it holds
/// the generators' locks exclusively.
enum class Draws : uint8_t { Unknown, Yes, No };

/// One stage's view of a run (a forward call and its backward).
struct StageRun {
  std::vector<Draws> draws;
  /// True when some cell of the run is checkpointed: only then do cells
  /// take the generator locks.
  bool any_checkpoint = false;
};

class Stage {
 public:
  Stage(int64_t index, std::unique_ptr<Layers> layers, c10::Device device);

  int64_t index() const noexcept { return index_; }
  const Lane& lane() const noexcept { return lane_; }
  c10::Device device() const noexcept { return lane_.device; }
  size_t generator_count() const noexcept { return generators_.size(); }
  /// Whether any parameter of the stage's layers requires grad.
  bool layers_require_grad() const { return layers_->requires_grad(); }

  /// F(i). Under grad mode keeps in `cell` what backward needs: the graph,
  /// or (checkpointed) only the input and the generator states. Returns the
  /// outputs for the next stage, without history but with the grad flags
  /// the next stage must honour.
  Batch forward(Cell& cell, StageRun& run, const Batch& input, bool checkpoint);

  /// The first half of B(i) for a checkpointed cell: rebuilds the stage's
  /// graph from the saved input with the saved generator states, under
  /// `forward_state`, the thread-local state (autocast included) of the
  /// cell's first forward, with grad mode on.
  void recompute(Cell& cell, const at::ThreadLocalState& forward_state);

  /// B(i) (after `recompute` for a checkpointed cell): back-propagates
  /// `grads` (one per output, undefined where none) through the stage and
  /// returns the grads of the cell's inputs. `keep_graph` keeps the cell
  /// usable for another backward.
  Batch backward(Cell& cell, const Batch& grads, bool keep_graph);

 private:

  int64_t index_;
  std::unique_ptr<Layers> layers_;
  Lane lane_;
  std::vector<at::Generator> generators_;
  /// Whether the layers modify their input in place (0 unknown, 1 yes, 2
  /// no): a checkpointed cell must then save a copy to recompute from.
  std::atomic<int> mutates_input_{0};
};

}  // namespace gpipe::detail
