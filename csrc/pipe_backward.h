// pipe_backward.h — the autograd node that lets loss.backward() drive the backward half of the schedule.
//
//   x ──> [forward half: all F(i) on the workers] ──> y (grad_fn = PipeBackward)
//   loss.backward():  ... ──> PipeBackward::apply(dy) ──> [all B(i)] ──> dx
//
// Each cell's stage-local graph lives outside the outer graph; the node is
// the only link between them. It has one edge per input tensor (empty where
// the input needs no grad), then one edge per outside tensor the cells reach
// (parameters' accumulators, tied weights, closures), and is the grad_fn of
// every output that needs grad. It computes only the edges autograd asks
// for, so `backward`, `backward(inputs=...)`, `autograd::grad` and parameter
// hooks behave as with the plain model. Where autograd would only add an
// edge's grad into a leaf's .grad (no hooks, not autograd::grad), the stages
// add each micro-batch's grad there themselves as it arrives and the edge's
// output is undefined; otherwise the node returns the grad summed over
// micro-batches:
//
//   loss.backward():     cells -> 0.weight.grad += g(i), as each arrives
//   hooked parameter:    PipeBackward -> sum of g(i) -> AccumulateGrad (hook once)
//   grad(out, {x}):      PipeBackward -> x only; no .grad is touched
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>

namespace gpipe::detail {

struct PipeRun;

class PipeBackward : public torch::autograd::Node {
 public:
  explicit PipeBackward(std::shared_ptr<PipeRun> run);

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "gpipe::PipeBackward"; }
  void release_variables() override;

 private:
  std::shared_ptr<PipeRun> run_;
};

}  // namespace gpipe::detail
