// pipe_backward.cpp — PipeBackward: hands the outer backward's grads to the engine's backward half.
#include "pipe_backward.h"

#include "engine.h"
#include "graph.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

namespace gpipe::detail {

namespace {

// Whether autograd would do nothing with this edge's grad but add it into a
// leaf's .grad: the edge leads to an accumulator without hooks, and the
// running backward accumulates there (a plain backward, or backward(inputs)
// naming it; not autograd::grad, which captures). The stages may then add
// each micro-batch's grad into .grad themselves, as the plain model's
// backward does layer by layer, instead of holding a second copy of every
// parameter's grad until PipeBackward returns.
bool accumulates_plainly(const torch::autograd::Edge& edge) {
  auto* acc = plain_accumulator(edge);
  if (acc == nullptr) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;
  auto it = exec_info->find(acc);
  return it != exec_info->end() && it->second.needed_ && !it->second.captures_;
}

// A node with no outputs: running it only makes autograd note its stream
// as a leaf stream (see pipe_backward.h).
class StreamLeaf : public torch::autograd::Node {
 public:
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    return {};
  }
  std::string name() const override { return "gpipe::StreamLeaf"; }
};

// What PipeBackward hands a stream leaf: an empty tensor of the leaf's
// metadata (no memory; autograd checks grads against the metadata).
at::Tensor leaf_grad(const torch::autograd::Edge& edge) {
  return at::empty({0}, edge.function->input_metadata(edge.input_nr).options());
}

}  // namespace

torch::autograd::edge_list stream_leaf_edges(const std::vector<c10::Device>& devices) {
  torch::autograd::edge_list edges;
  std::vector<c10::Device> seen;
  for (const auto& device : devices) {
    if (device.is_cpu() || std::find(seen.begin(), seen.end(), device) != seen.end()) continue;
    seen.push_back(device);
    auto leaf = std::shared_ptr<StreamLeaf>(new StreamLeaf(), torch::autograd::deleteNode);
    c10::impl::VirtualGuardImpl impl(device.type());
    // The metadata records the stream current on its device: the default one.
    const c10::StreamGuard on_default(impl.getDefaultStream(device));
    const std::vector<c10::SymInt> empty{c10::SymInt(0)};
    const uint32_t input = leaf->add_input_metadata(at::TensorOptions(at::kFloat).device(device),
                                                    empty, /*is_tensor_subclass=*/false,
                                                    /*is_nested=*/false, std::nullopt);
    edges.emplace_back(std::move(leaf), input);
  }
  return edges;
}

PipeBackward::PipeBackward(std::shared_ptr<PipeRun> run, size_t stream_leaves)
    : run_(std::move(run)), stream_leaves_(stream_leaves) {}

torch::autograd::variable_list PipeBackward::apply(torch::autograd::variable_list&& grads) {
  TORCH_CHECK(run_, "gpipe::Pipe: this output's graph was already freed by an earlier backward; "
                    "pass retain_graph=true to the first backward to run backward twice");
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "gpipe::Pipe does not support create_graph=true (double backward) yet; "
              "call backward without create_graph");
  const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
  std::shared_ptr<PipeRun> run = run_;
  if (!keep_graph) run_.reset();
  const size_t outputs = num_outputs() - stream_leaves_;
  std::vector<bool> needed(outputs);
  for (size_t e = 0; e < needed.size(); ++e) needed[e] = task_should_compute_output(e);
  const size_t inputs = run->input_devices.size();
  std::vector<bool> accumulate(run->externals.size(), false);
  for (size_t e = 0; e < accumulate.size(); ++e) {
    accumulate[e] = needed[inputs + e] && accumulates_plainly(next_edge(inputs + e));
  }
  auto result = run->engine->backward(*run, grads, keep_graph, needed, accumulate);
  result.resize(outputs);
  // After the engine's end wait (every device's default stream waited for
  // every lane): the stream leaves may run.
  for (size_t e = outputs; e < num_outputs(); ++e) {
    result.push_back(task_should_compute_output(e) ? leaf_grad(next_edge(e)) : at::Tensor());
  }
  return result;
}

void PipeBackward::release_variables() { run_.reset(); }

}  // namespace gpipe::detail
