// pipe_backward.cpp — PipeBackward: hands the outer backward's grads to the engine's backward half.
#include "pipe_backward.h"

#include "engine.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

namespace gpipe::detail {

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
  return run->engine->backward(*run, grads, keep_graph, needed);
}

void PipeBackward::release_variables() { run_.reset(); }

}  // namespace gpipe::detail
