// split.cpp — finding a cell's input path and frontier nodes, and catching their grads in I.
#include "split.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>

namespace gpipe::detail {

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;

// Catches the grads arriving at a frontier node while armed (in I); passes
// them on unchanged either way.
struct CatchGrads : torch::autograd::FunctionPreHook {
  explicit CatchGrads(std::shared_ptr<Caught> caught) : caught(std::move(caught)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (caught->armed) caught->grads = grads;
    return grads;
  }
  std::shared_ptr<Caught> caught;
};

// A set of capture numbers.
class Bits {
 public:
  explicit Bits(size_t n = 0) : words_((n + 63) / 64, 0) {}
  void set(size_t k) { words_[k / 64] |= uint64_t{1} << (k % 64); }
  void merge(const Bits& other) {
    for (size_t w = 0; w < words_.size(); ++w) words_[w] |= other.words_[w];
  }
  bool intersects(const Bits& other) const {
    for (size_t w = 0; w < words_.size(); ++w) {
      if ((words_[w] & other.words_[w]) != 0) return true;
    }
    return false;
  }
  bool test(size_t k) const { return (words_[k / 64] >> (k % 64)) & 1; }

 private:
  std::vector<uint64_t> words_;
};

struct Info {
  bool input_path = false;  // leads to an input sink
  Bits reach;               // captures it leads to
  bool done = false;
};

bool has_hooks(const Node& node) {
  auto& n = const_cast<Node&>(node);
  return !n.pre_hooks().empty() || !n.post_hooks().empty() || !n.tensor_pre_hooks().empty() ||
         !n.retains_grad_hooks().empty();
}

}  // namespace

WeightSplit split_weights(const std::vector<at::Tensor>& outputs,
                          const std::vector<const Node*>& inputs, const Cut& cut) {
  const size_t n_captures = cut.capture_nodes.size();
  std::unordered_map<const Node*, size_t> capture_of;
  for (size_t e = 0; e < n_captures; ++e) {
    const auto& node = cut.capture_nodes[e];
    // A capture node shared by several edges (cut_at_externals'
    // share_small) would pull a W run toward one of them onto the other
    // edges' paths: such a cell is not split.
    if (node && node->num_inputs() != 1) return WeightSplit{};
    if (node) capture_of.emplace(node.get(), e);
  }
  std::unordered_map<const Node*, bool> input_nodes;  // where the wanted input grads end
  for (const Node* input : inputs) {
    if (input != nullptr) input_nodes.emplace(input, true);
  }
  // Post-order walk (explicit stack: graphs can be deep) from the outputs
  // through the cell's own nodes; captures and input nodes end it.
  std::unordered_map<Node*, Info> info;
  auto internal = [&](const Node* node) {
    return node != nullptr && capture_of.count(node) == 0 && input_nodes.count(node) == 0;
  };
  std::vector<std::pair<Node*, bool>> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    Node* node = torch::autograd::impl::gradient_edge(out).function.get();
    if (internal(node)) stack.emplace_back(node, false);
  }
  while (!stack.empty()) {
    auto [node, expanded] = stack.back();
    stack.pop_back();
    Info& mine = info[node];
    if (mine.done) continue;
    if (!expanded) {
      stack.emplace_back(node, true);
      for (const auto& edge : node->next_edges()) {
        Node* next = edge.function.get();
        if (internal(next) && !info[next].done) stack.emplace_back(next, false);
      }
      continue;
    }
    Info result;
    result.reach = Bits(n_captures);
    for (const auto& edge : node->next_edges()) {
      const Node* next = edge.function.get();
      if (next == nullptr) continue;
      if (input_nodes.count(next) != 0) {
        result.input_path = true;
      } else if (auto it = capture_of.find(next); it != capture_of.end()) {
        result.reach.set(it->second);
      } else {
        const Info& child = info[const_cast<Node*>(next)];
        result.input_path = result.input_path || child.input_path;
        result.reach.merge(child.reach);
      }
    }
    result.done = true;
    info[node] = std::move(result);
  }

  auto targets_of = [&](const Bits& bits) {
    std::vector<size_t> targets;
    for (size_t e = 0; e < n_captures; ++e) {
      if (bits.test(e)) targets.push_back(e);
    }
    return targets;
  };
  WeightSplit split;
  // Frontier nodes: on the input path, with edges leaving it.
  for (auto& [node, mine] : info) {
    if (!mine.input_path) continue;
    Bits leaving(n_captures);
    Bits staying(n_captures);
    bool leaves_path = false;
    for (const auto& edge : node->next_edges()) {
      const Node* next = edge.function.get();
      if (next == nullptr || input_nodes.count(next) != 0) continue;
      if (auto it = capture_of.find(next); it != capture_of.end()) {
        leaving.set(it->second);
        leaves_path = true;
        continue;
      }
      const Info& child = info[const_cast<Node*>(next)];
      if (child.input_path) {
        staying.merge(child.reach);
      } else {
        leaving.merge(child.reach);
        leaves_path = true;
      }
    }
    if (!leaves_path) continue;
    if (leaving.intersects(staying) || has_hooks(*node)) return WeightSplit{};
    WeightRoot root;
    root.node = node->getptr();
    root.caught = std::make_shared<Caught>();
    root.targets = targets_of(leaving);
    if (root.targets.empty()) continue;
    split.roots.push_back(std::move(root));
  }
  // Outputs whose graph leads to no input: W starts from the output itself.
  for (size_t k = 0; k < outputs.size(); ++k) {
    const auto& out = outputs[k];
    if (!out.defined() || !out.requires_grad() || cut.direct[k] >= 0) continue;
    Node* node = torch::autograd::impl::gradient_edge(out).function.get();
    if (!internal(node) || info[node].input_path) continue;
    WeightRoot root;
    root.output = static_cast<int64_t>(k);
    root.targets = targets_of(info[node].reach);
    if (!root.targets.empty()) split.roots.push_back(std::move(root));
  }
  // A fixed order (outputs first, then later nodes first, as autograd runs
  // them), so grads shared between roots add up in the same order each step.
  std::stable_sort(split.roots.begin(), split.roots.end(), [](const WeightRoot& a, const WeightRoot& b) {
    if ((a.node == nullptr) != (b.node == nullptr)) return a.node == nullptr;
    if (a.node == nullptr) return a.output < b.output;
    return a.node->sequence_nr() > b.node->sequence_nr();
  });
  for (auto& root : split.roots) {
    if (root.node) root.node->add_pre_hook(std::make_unique<CatchGrads>(root.caught));
  }
  split.splittable = true;
  return split;
}

}  // namespace gpipe::detail
