// stage.h — one stage: its layers on one device, running a micro-batch forward, recompute and backward.
#pragma once

#include "graph.h"
#include "microbatch.h"
#include "split.h"
#include "streams.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Generator.h>
#include <c10/core/Device.h>
#include <c10/core/TensorImpl.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace gpipe::detail {

class GeneratorLock;  // rng.h

/// The layers of one stage, callable on a batch. The C++ Pipe runs
/// `torch::nn::AnyModule`s; the Python package runs Python modules.
class Layers {
 public:
  virtual ~Layers() = default;
  /// Runs the layers in order on `input` (already on the stage's device).
  virtual Batch forward(const Batch& input) = 0;
  /// The training flags of the layers and of every module they hold, in a
  /// fixed order. While they stay as they were in a step in which the stage
  /// drew no random numbers, its next step starts known not to draw
  /// (Stage::begin_step).
  virtual std::vector<bool> training_flags() const = 0;
};

/// Tensors whose in-place change makes a later backward refuse, as
/// autograd's saved-tensor check would for what the plain model saved.
class VersionWatch {
 public:
  /// Watches every defined tensor of `batch` from its version now on.
  void watch(const Batch& batch);
  void clear();
  /// Throws autograd's "modified by an inplace operation", naming `what`.
  void check(const std::string& what) const;

 private:
  std::vector<c10::VariableVersion> counters_;
  std::vector<uint32_t> versions_;
};

/// Where a cell's backward sends the grads of one external edge.
struct ExternalSink {
  /// Whether autograd asked for them at all.
  bool wanted = false;
  /// Non-null: straight into this leaf's `.grad` (through `slot`, which
  /// orders the writers), micro-batch by micro-batch, as a hook-free
  /// AccumulateGrad would; else returned.
  torch::autograd::AccumulateGrad* accumulate = nullptr;
  GradSlot* slot = nullptr;
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
  /// Checkpointed: the input as handed in, watched from the end of the
  /// first forward; the recompute refuses to run from it once changed.
  VersionWatch input_watch;
  /// Checkpointed: the state of each of the stage's generators before the
  /// first forward (undefined where the stage does not draw from it).
  std::vector<at::Tensor> rng_before;
  /// Stage-local graph: the nodes where the input grads end (null where an
  /// input needs no grad; stage.cpp's `enter`) and the outputs it starts
  /// from.
  std::vector<std::shared_ptr<Capture>> input_sinks;
  Batch outputs;
  /// Where the stage-local graph reaches tensors the cell did not make
  /// (parameters, tied weights, tensors the layers close over): the grads
  /// flowing there are the cell's share of theirs. Set by forward (also
  /// for a checkpointed cell, whose graph is then dropped) and recompute;
  /// see graph.h.
  Cut cut;
  /// Whether the cut lets small edges share a capture node (graph.h's
  /// cut_at_externals): not where the backward is split in I and W.
  bool share_captures = false;
  /// Between I and W (zero-bubble): what W still has to do, the output
  /// grads it may start from, and where it starts.
  enum class Deferred : uint8_t { Nothing, Whole, Split };
  Deferred deferred = Deferred::Nothing;
  Batch output_grads;
  std::shared_ptr<WeightSplit> split;
};

/// What a cell's forward needs to know about the step's random streams.
struct CellDraws {
  int64_t microbatch = 0;
  /// Set when the step gives each cell a stream of its own on the shared
  /// generators (several micro-batches; see rng.h): the step's seed.
  std::optional<uint64_t> step_seed;
};

class Stage {
 public:
  Stage(int64_t index, std::unique_ptr<Layers> layers, c10::Device device);

  int64_t index() const noexcept { return index_; }
  const Lane& lane() const noexcept { return lane_; }
  c10::Device device() const noexcept { return lane_.device; }
  size_t generator_count() const noexcept { return generators_.size(); }
  /// F(i). Under grad mode builds the stage-local graph (so the outputs
  /// need grad exactly where the plain model's would, and `cell.externals`
  /// is known) and keeps in `cell` what backward needs: the graph, or
  /// (checkpointed) only the input and the generator states. A checkpointed
  /// cell keeps its graph after all when its random draws could not be
  /// snapshotted (see rng.h). `any_checkpoint`: some cell of this run is
  /// checkpointed, so every cell takes the generator locks. `draws`: the
  /// micro-batch and, when the step gives cells streams of their own, the
  /// step's seed (see CellDraws). `share_captures`: the cut may let small
  /// outside edges share a capture node (graph.h; false where this cell's
  /// backward will be split in I and W). Returns the outputs for the next stage,
  /// without history but with the grad flags the next stage must honour.
  /// A checkpointed cell watches its input: changed in place before the
  /// recompute, it makes the recompute refuse, as autograd's saved-tensor
  /// check would.
  Batch forward(Cell& cell, const Batch& input, bool checkpoint, bool any_checkpoint,
                const CellDraws& draws, bool share_captures);

  /// Which of the stage's generators (see generators_for) other workers of
  /// the pipe draw from too: those get a stream per cell when a step has
  /// several micro-batches (rng.h). Set once, before the first step.
  void set_shared_generators(std::vector<bool> shared);
  const std::vector<bool>& shared_generators() const noexcept { return shared_; }
  /// Starts a step: what the stage learned about its draws is relearned
  /// (see Stage::forward), keeping only "draws" for a generator it drew from
  /// in the step before.
  void begin_step();

  /// The first half of B(i) for a checkpointed cell: rebuilds the stage's
  /// graph from the saved input with the saved generator states, under
  /// `forward_state`, the thread-local state (autocast included) of the
  /// cell's first forward, with grad mode on.
  void recompute(Cell& cell, const at::ThreadLocalState& forward_state);

  /// B(i) (after `recompute` for a checkpointed cell): back-propagates
  /// `grads` (one per output, undefined where none) through the stage and
  /// returns the grads of the cell's inputs. For each of
  /// `cell.cut.externals`, `sinks` says where its grad goes: into a leaf's
  /// `.grad`, or into `external_grads` (undefined where none or unwanted).
  /// Input grads are computed where `wanted_inputs` says so (one flag per
  /// input value), so autograd runs only the parts of the graph it must.
  /// `keep_graph` keeps the cell usable for another backward.
  Batch backward(Cell& cell, const Batch& grads, bool keep_graph,
                 const std::vector<bool>& wanted_inputs, const std::vector<ExternalSink>& sinks,
                 std::vector<at::Tensor>& external_grads);

  /// I(i) of zero-bubble (after `recompute` for a checkpointed cell): like
  /// `backward`, but computes only the grads of the cell's inputs and keeps
  /// the graph and what W needs in `cell`. A cell that cannot be split (see
  /// split.h) runs its whole backward here, into `sinks`; a cell with no
  /// input grad wanted leaves all of it to W.
  Batch backward_input(Cell& cell, const Batch& grads, const std::vector<bool>& wanted_inputs,
                       const std::vector<ExternalSink>& sinks,
                       std::vector<at::Tensor>& external_grads);
  /// W(i): the grads of the external edges that I left, into `sinks` (as
  /// `backward` does); frees the cell.
  void backward_weight(Cell& cell, const std::vector<ExternalSink>& sinks,
                       std::vector<at::Tensor>& external_grads);

 private:
  int64_t index_;
  std::unique_ptr<Layers> layers_;
  Lane lane_;
  std::vector<at::Generator> generators_;
  /// Their process-wide locks (lock_for, looked up once: a cell takes them
  /// without the registry's mutex).
  std::vector<GeneratorLock*> generator_locks_;
  /// Whether the layers modify their input in place (0 unknown, 1 yes, 2
  /// no): a checkpointed cell must then save a copy to recompute from.
  std::atomic<int> mutates_input_{0};
  /// Per generator: whether this stage's cells draw from it (unknown, yes,
  /// no), learned in a step and kept while nothing says otherwise; see
  /// stage.cpp.
  std::array<std::atomic<int>, 2> draws_{};
  /// The layers' training flags, then grad mode, at the start of this step
  /// (begin_step).
  std::vector<bool> training_flags_;
  /// Per generator: whether some cell of this step was seen drawing from it.
  std::array<std::atomic<bool>, 2> drew_{};
  std::vector<bool> shared_;
};

}  // namespace gpipe::detail
