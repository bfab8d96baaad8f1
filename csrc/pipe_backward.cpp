// pipe_backward.cpp — PipeBackward: hands the outer backward's grads to the engine's backward half.
#include "pipe_backward.h"

#include "engine.h"
#include "graph.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>

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

}  // namespace

PipeBackward::PipeBackward(std::shared_ptr<PipeRun> run) : run_(std::move(run)) {}

torch::autograd::variable_list PipeBackward::apply(torch::autograd::variable_list&& grads) {
  TORCH_CHECK(run_, "gpipe::Pipe: this output's graph was already freed by an earlier backward; "
                    "pass retain_graph=true to the first backward to run backward twice");
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "gpipe::Pipe does not support create_graph=true (double backward) yet; "
              "call backward without create_graph");
  const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
  std::shared_ptr<PipeRun> run = run_;
  if (!keep_graph) run_.reset();
  std::vector<bool> needed(num_outputs());
  for (size_t e = 0; e < needed.size(); ++e) needed[e] = task_should_compute_output(e);
  const size_t inputs = run->input_devices.size();
  std::vector<bool> accumulate(run->externals.size(), false);
  for (size_t e = 0; e < accumulate.size(); ++e) {
    accumulate[e] = needed[inputs + e] && accumulates_plainly(next_edge(inputs + e));
  }
  return run->engine->backward(*run, grads, keep_graph, needed, accumulate);
}

void PipeBackward::release_variables() { run_.reset(); }

}  // namespace gpipe::detail
