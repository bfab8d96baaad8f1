// graph.cpp — telling a cell's own autograd nodes from the rest, and collecting the edges between them.
#include "graph.h"

#include "streams.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>

namespace gpipe::detail {

using torch::autograd::Edge;
using torch::autograd::Node;

GraphWindow::GraphWindow()
    : thread_(at::RecordFunction::currentThreadId()),
      first_(at::sequence_number::peek()),
      end_(std::numeric_limits<uint64_t>::max()) {}

void GraphWindow::close() { end_ = at::sequence_number::peek(); }

bool GraphWindow::contains(const Node& node) const {
  if (node.thread_id() != thread_) return false;
  const uint64_t n = node.sequence_nr();
  if (n >= first_ && n < end_) return true;
  // A few nodes take no number (UINT64_MAX): accumulators, which belong to
  // their leaf and never to a cell, and error nodes (a layer with no
  // derivative), which the cell's thread made for the cell.
  return n == std::numeric_limits<uint64_t>::max() &&
         dynamic_cast<const torch::autograd::AccumulateGrad*>(&node) == nullptr;
}

uint32_t Capture::add(const torch::autograd::InputMetadata& metadata) {
  // The same shape, dtype and device as the input it stands in for, so
  // autograd checks the grads arriving here as it would have there; the
  // stream is the current one, the cell's (its backward runs there).
  const uint32_t input =
      add_input_metadata(metadata.options(), metadata.shape_as_dim_vector(),
                         metadata.is_tensor_subclass(), metadata.is_nested_tensor(),
                         metadata.grad_dtype());
  sinks.emplace_back();
  return input;
}

void GradSlot::after_last_write(c10::Device device) {
  if (device.is_cpu() || !last_) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  last_->block(impl.getStream(device));  // across devices too: a legal wait
}

void GradSlot::wrote(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  // An event records on streams of one device; a write on another device
  // (after waiting for this one, above) starts a new one.
  if (!last_ || last_->device() != device) last_.emplace(device.type());
  last_->record(impl.getStream(device));
}

void accumulate_into(torch::autograd::AccumulateGrad& accumulator, GradSlot& slot,
                     const at::Tensor& grad) {
  std::lock_guard<std::mutex> hold(slot.mutex);
  at::Tensor& sum = accumulator.variable.mutable_grad();
  // The add runs on the current stream of the grad's device (the cell's
  // compute stream), where the leaf's .grad lives.
  slot.after_last_write(grad.device());
  const at::Tensor before = sum;
  torch::autograd::AccumulateGrad::accumulateGrad(
      accumulator.variable, sum, grad, /*num_expected_refs=*/1,
      [&sum](at::Tensor&& update) { sum = std::move(update); });
  if (before.defined() && !before.is_same(sum)) {
    // Replaced out of place: the old .grad, made on another writer's
    // stream, is freed when `before` goes, while the add reading it may
    // still be queued here; the allocator must not hand its block to that
    // other stream before then.
    record_on_current_streams({before});
  }
  slot.wrote(grad.device());
}

torch::autograd::AccumulateGrad* plain_accumulator(const Edge& edge) {
  auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get());
  if (acc == nullptr) return nullptr;
  if (!acc->pre_hooks().empty() || !acc->post_hooks().empty() ||
      !acc->tensor_pre_hooks().empty() || !acc->retains_grad_hooks().empty() ||
      acc->tensor_post_acc_grad_hooks() != nullptr) {
    return nullptr;
  }
  return acc;
}

torch::autograd::variable_list Capture::apply(torch::autograd::variable_list&& grads) {
  TORCH_INTERNAL_ASSERT(grads.size() == sinks.size());
  for (size_t k = 0; k < grads.size(); ++k) {
    at::Tensor& g = grads[k];
    const Sink& sink = sinks[k];
    if (!g.defined()) continue;
    if (sink.accumulate != nullptr) {
      accumulate_into(*sink.accumulate, *sink.slot, g);
    } else if (sink.into != nullptr) {
      *sink.into = sink.into->defined() ? *sink.into + g : std::move(g);
    }
  }
  return {};
}

namespace {

// The bytes of the grad an input described by `metadata` takes, or -1 where
// it is not a plain dense tensor of known size.
int64_t grad_bytes(const torch::autograd::InputMetadata& metadata) {
  if (metadata.is_tensor_subclass() || metadata.is_nested_tensor() ||
      metadata.is_cpp_nested_tensor() || metadata.options().layout() != c10::kStrided) {
    return -1;
  }
  int64_t numel = 1;
  for (const auto& size : metadata.shape_as_dim_vector()) {
    const auto known = size.maybe_as_int();
    if (!known) return -1;
    numel *= *known;
  }
  return numel * static_cast<int64_t>(metadata.options().dtype().itemsize());
}

}  // namespace

Cut cut_at_externals(const std::vector<at::Tensor>& outputs, const GraphWindow& window,
                     const std::vector<const Node*>& inputs, bool share_small) {
  SmallMap<const Node*, size_t> own_inputs;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k] != nullptr) own_inputs.emplace(inputs[k], k);
  }
  Cut cut;
  cut.reached.assign(inputs.size(), false);
  // Autograd runs a node on the thread of the first non-CPU device its
  // grads arrive on (InputBuffer::device): note each such device.
  auto needs = [&](const torch::autograd::InputMetadata& metadata) {
    const c10::Device device = metadata.device();
    if (device.is_cpu()) return;
    if (std::find(cut.devices.begin(), cut.devices.end(), device) == cut.devices.end()) {
      cut.devices.push_back(device);
    }
  };
  auto own_input = [&](const Node* node) {
    const size_t* k = own_inputs.find(node);
    if (k == nullptr) return false;
    if (!cut.reached[*k]) {
      cut.reached[*k] = true;
      needs(node->input_metadata(0));  // the input's grad arrives there
    }
    return true;
  };
  EdgeIndex numbers;
  auto external = [&](const Edge& edge) {
    const auto before = numbers.size();
    const int64_t e = numbers.add(edge);
    if (numbers.size() != before) {
      cut.externals.push_back(edge);
      cut.captures.emplace_back();
      cut.capture_nodes.emplace_back();
      cut.producers.emplace_back();
    }
    return e;
  };
  // The shared capture node being filled, per device, and its bytes.
  struct Shared {
    c10::Device device;
    std::shared_ptr<Capture> node;
    int64_t bytes;
  };
  std::vector<Shared> shared;
  auto node_for = [&](const torch::autograd::InputMetadata& metadata) {
    const int64_t bytes = share_small ? grad_bytes(metadata) : -1;
    if (bytes < 0 || bytes > kShareBytes) return std::make_shared<Capture>();
    const c10::Device device = metadata.device();
    auto it = std::find_if(shared.begin(), shared.end(),
                           [&](const Shared& s) { return s.device == device; });
    if (it == shared.end()) {
      it = shared.insert(shared.end(), Shared{device, nullptr, 0});
    }
    if (!it->node || it->bytes + bytes > kShareNodeBytes) {
      it->node = std::make_shared<Capture>();
      it->bytes = 0;
    }
    it->bytes += bytes;
    return it->node;
  };
  auto capture = [&](int64_t e) {
    auto& slot = cut.captures[static_cast<size_t>(e)];
    if (!slot.is_valid()) {
      const Edge& outside = cut.externals[static_cast<size_t>(e)];
      const auto& metadata = outside.function->input_metadata(outside.input_nr);
      needs(metadata);
      auto node = node_for(metadata);
      const uint32_t input = node->add(metadata);
      cut.capture_nodes[static_cast<size_t>(e)] = node;
      slot = Edge(std::move(node), input);
    }
    return slot;
  };
  auto inside = [&](const Node* node) {
    return own_inputs.find(node) != nullptr || window.contains(*node);
  };

  SmallMap<const Node*, char> visited;
  std::vector<Node*> stack;
  cut.direct.assign(outputs.size(), -1);
  for (size_t k = 0; k < outputs.size(); ++k) {
    const auto& out = outputs[k];
    if (!out.defined() || !out.requires_grad()) continue;
    const Edge edge = torch::autograd::impl::gradient_edge(out);
    Node* node = edge.function.get();
    if (!inside(node)) {
      cut.direct[k] = external(edge);
    } else if (!own_input(node) && visited.emplace(node, 1).second) {
      stack.push_back(node);
    }
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (uint32_t i = 0; i < node->num_inputs(); ++i) needs(node->input_metadata(i));
    for (uint32_t i = 0; i < node->num_outputs(); ++i) {
      const Edge& edge = node->next_edge(i);
      Node* next = edge.function.get();
      if (next == nullptr || own_input(next)) continue;
      if (window.contains(*next)) {
        if (visited.emplace(next, 1).second) stack.push_back(next);
        continue;
      }
      const int64_t e = external(edge);
      // Written in place: set_next_edge would renumber the node's
      // topological order, which autograd forbids once the node has parents.
      // A capture node has no children (topological number 0), so the order
      // stays valid.
      node->next_edges()[i] = capture(e);
      cut.producers[static_cast<size_t>(e)].emplace_back(node, i);
    }
  }
  return cut;
}

int64_t EdgeIndex::add(const Edge& edge) {
  auto [number, added] = numbers_.emplace(Key(edge.function.get(), edge.input_nr),
                                          static_cast<int64_t>(edges_.size()));
  if (added) edges_.push_back(edge);
  return *number;
}

int64_t EdgeIndex::find(const Edge& edge) const {
  const int64_t* number = numbers_.find(Key(edge.function.get(), edge.input_nr));
  return number == nullptr ? -1 : *number;
}

}  // namespace gpipe::detail
