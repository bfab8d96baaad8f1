// graph.h — where a cell's autograd graph leaves what the cell built: edges to parameters and other outside tensors.
//
// A cell's forward builds a stage-local graph that starts at the nodes where
// the cell's input grads end. It also reaches tensors the cell did not make: the layers'
// parameters, a weight tied to another module, a tensor a layer closes over.
// The plain model sends grads into those; so must the Pipe. Their edges
// become edges of the PipeBackward node, and each cell's backward collects
// the grads flowing into them (at capture nodes that stand in for them)
// instead of accumulating them itself:
//
//   cell graph:   out <- ... <- input sinks (Capture)             (internal)
//                          \
//                           `--> Capture  (was: AccumulateGrad(W) or W.grad_fn)
//   PipeBackward ------------->  AccumulateGrad(W), W.grad_fn      (external)
//
// A node is the cell's own when the cell's thread made it while the cell ran:
// autograd numbers the nodes each thread makes (`sequence_nr`, with the
// thread's id), so the numbers taken before and after the forward bound them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpipe::detail {

/// The autograd nodes the calling thread makes between construction and
/// `close()`.
class GraphWindow {
 public:
  GraphWindow();
  void close();
  /// Whether `node` was made inside the window.
  bool contains(const torch::autograd::Node& node) const;

 private:
  uint64_t thread_;
  uint64_t first_;
  uint64_t end_;
};

/// Where the grads of one outside tensor meet within a step (its leaf's
/// `.grad`, or a sum of them): several stages' workers write there, each on
/// its own stream. `mutex` orders the host calls; on an accelerator the
/// device work needs ordering too, or two stages' `+=` run at once on two
/// streams and one update is lost:
///
///   stage 0 compute   B(0,i): wait(last) .grad += g  rec(last)
///   stage 3 compute                                   wait(last) .grad += g'  rec(last)
///
/// Each writer's stream waits for the last writer's event, then records its
/// own. A reader on a stage stream (the reducer's flat copy) waits too; the
/// caller's streams are ordered after every lane at the end of the step
/// (streams.h). All no-ops on the CPU.
class GradSlot {
 public:
  /// Held around a write: the host calls one at a time.
  std::mutex mutex;
  /// The current stream of `device` waits for the last write (under mutex).
  void after_last_write(c10::Device device);
  /// Marks a write just queued on the current stream of `device` (under mutex).
  void wrote(c10::Device device);

 private:
  std::optional<c10::Event> last_;
};

/// Adds `grad` into `accumulator`'s leaf's `.grad` as a hook-free
/// AccumulateGrad would (the first grad is stolen, the rest added in place),
/// ordered after the slot's earlier writes.
void accumulate_into(torch::autograd::AccumulateGrad& accumulator, GradSlot& slot,
                     const at::Tensor& grad);

/// The accumulator `edge` leads to when it is an AccumulateGrad without
/// hooks (autograd would only add into its leaf's `.grad` there), else null.
torch::autograd::AccumulateGrad* plain_accumulator(const torch::autograd::Edge& edge);

/// Stands in for outside nodes inside a cell's graph (see `Cut`), one input
/// per outside edge; and, with one input, is where a cell's input grad ends
/// (stage.cpp's `enter`). When a backward runs it, it hands the grad
/// arriving at each input to that input's sink: adds it into `into` (a sum
/// the cell's backward reads), or into `accumulate`'s `.grad` through
/// `slot`, as an AccumulateGrad without hooks would. It has no hooks of its
/// own.
///
/// Autograd runs a node once all the grads flowing into it are there, so a
/// capture node with several inputs holds the first grads until the last
/// one comes; what it saves is the engine's cost per node run (~1.5 us on
/// the CPU, against a few for the whole cell's backward of small layers).
/// `cut_at_externals` gives several inputs to one node only where those
/// grads are small (see there).
class Capture : public torch::autograd::Node {
 public:
  /// Where one input's grad goes in the next backward; set by the cell's
  /// backward for the inputs it wants, and reset after it.
  struct Sink {
    at::Tensor* into = nullptr;
    torch::autograd::AccumulateGrad* accumulate = nullptr;
    GradSlot* slot = nullptr;
  };
  /// Adds an input standing in for an outside node's input described by
  /// `metadata`; returns its number.
  uint32_t add(const torch::autograd::InputMetadata& metadata);
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "gpipe::Capture"; }

  /// One per input.
  std::vector<Sink> sinks;
};

/// A cell's graph, cut where it leaves the cell.
struct Cut {
  /// The edges leaving the cell's graph, once each, in the order first
  /// reached (edges into the nodes where the cell's input grads end are not
  /// among them).
  std::vector<torch::autograd::Edge> externals;
  /// For each external edge, where the grads from inside the cell now
  /// arrive: an input of a capture node standing in for the outside node,
  /// so a backward can collect them without running the outside node or
  /// its hooks (parameter hooks fire once, when autograd hands the summed
  /// grad on). Invalid where only an output itself is the outside tensor.
  std::vector<torch::autograd::Edge> captures;
  /// The capture nodes themselves (null where the edge is invalid); with
  /// `share_small`, one node may serve several edges (at different inputs).
  std::vector<std::shared_ptr<Capture>> capture_nodes;
  /// For each external edge, the cell's nodes and output numbers whose edge
  /// now points at its capture (the graph, kept alive by the cell's
  /// outputs, owns them): a backward that wants only some edges of a shared
  /// node points the others elsewhere for the run (`Stage::backward`). Valid
  /// only while that graph lives: a checkpointed cell frees it after its
  /// forward, and its recompute makes a new cut before any backward.
  std::vector<std::vector<std::pair<torch::autograd::Node*, uint32_t>>> producers;
  /// For each output: the number of the external edge it is (the layers
  /// returned an outside tensor as it is), or -1.
  std::vector<int64_t> direct;
  /// For each of the cell's inputs: whether the graph reaches its node (an
  /// output depends on that input).
  std::vector<bool> reached;
  /// The devices other than the CPU that the graph's nodes (capture nodes
  /// included) take grads on, once each. Autograd runs a node on the engine
  /// thread of that device, so a backward of this graph needs those threads
  /// (the deadlock rule, engine_backward.cpp).
  std::vector<c10::Device> devices;
};

/// Walks the graph behind `outputs` through the nodes inside `window` and
/// redirects each edge that leaves it to a capture node (see `Cut`).
/// `inputs`: for each of the cell's inputs, the node its grad ends in (null
/// where the input needs none); the walk stops there.
/// `share_small`: edges whose grads are small (up to kShareBytes each, a
/// plain dense tensor) share one capture node per device, up to
/// kShareNodeBytes per node, in the order the walk from the outputs
/// reaches them (about the order backward computes them): a node's grads
/// wait for the few computed next to them, and the engine runs one node
/// instead of one per bias or small weight. Not for a cell whose backward
/// is split (split.h): a run toward one input of a shared node would reach
/// the other inputs' paths too.
Cut cut_at_externals(const std::vector<at::Tensor>& outputs, const GraphWindow& window,
                     const std::vector<const torch::autograd::Node*>& inputs, bool share_small);
inline constexpr int64_t kShareBytes = int64_t{64} << 10;
inline constexpr int64_t kShareNodeBytes = int64_t{1} << 20;

/// A map searched linearly while it holds up to kLinear entries (a cell's
/// graph usually is that small: no hashing, one allocation), hashed past
/// that (a stage of hundreds of parameters).
template <typename Key, typename Value, typename Hash = std::hash<Key>>
class SmallMap {
 public:
  static constexpr size_t kLinear = 16;
  /// The value of `key`, or null.
  const Value* find(const Key& key) const {
    if (hashed_.empty()) {
      for (const auto& [k, v] : linear_) {
        if (k == key) return &v;
      }
      return nullptr;
    }
    auto it = hashed_.find(key);
    return it == hashed_.end() ? nullptr : &it->second;
  }
  /// Adds `key` with `value` unless present; the value now held, and
  /// whether it was added.
  std::pair<const Value*, bool> emplace(const Key& key, Value value) {
    if (const Value* found = find(key)) return {found, false};
    if (hashed_.empty() && linear_.size() < kLinear) {
      linear_.emplace_back(key, std::move(value));
      return {&linear_.back().second, true};
    }
    if (hashed_.empty()) {
      hashed_.reserve(2 * kLinear);
      for (auto& [k, v] : linear_) hashed_.emplace(k, std::move(v));
      linear_.clear();
    }
    return {&hashed_.emplace(key, std::move(value)).first->second, true};
  }

 private:
  std::vector<std::pair<Key, Value>> linear_;
  std::unordered_map<Key, Value, Hash> hashed_;
};

/// Numbers distinct edges (by node and input slot) in the order added.
class EdgeIndex {
 public:
  /// The edge's number, adding it when new.
  int64_t add(const torch::autograd::Edge& edge);
  /// The edge's number, or -1 when it was never added.
  int64_t find(const torch::autograd::Edge& edge) const;
  const std::vector<torch::autograd::Edge>& edges() const noexcept { return edges_; }
  size_t size() const noexcept { return edges_.size(); }

 private:
  using Key = std::pair<const torch::autograd::Node*, uint32_t>;
  struct Hash {
    size_t operator()(const Key& key) const noexcept {
      return std::hash<const void*>()(key.first) * 31 + key.second;
    }
  };
  SmallMap<Key, int64_t, Hash> numbers_;
  std::vector<torch::autograd::Edge> edges_;
};

}  // namespace gpipe::detail
