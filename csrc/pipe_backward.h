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
//
// Last come the stream leaves: one edge per accelerator device the stages
// (or the leaves they add into) use, to a node with no outputs whose stream
// is that device's default stream. Autograd counts the stream of a node
// with no outputs as a leaf stream and, when backward() returns, makes the
// stream that was current where backward() was called wait for it. The
// grads gpipe adds into .grad itself never pass an AccumulateGrad node, so
// without these a backward() under another stream than its forward's would
// return before the stages' writes (issue 23 item 10):
//
//   lanes on d        B(..) .grad += g
//   default(d)                          wait(lanes)   (current_streams_wait_for)
//   StreamLeaf(d)                                    runs: leaf stream = default(d)
//   caller's stream at backward()                    wait(default(d)) at backward's end
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <vector>

namespace gpipe::detail {

struct PipeRun;

class PipeBackward : public torch::autograd::Node {
 public:
  /// `stream_leaves`: how many of the last edges lead to stream leaves.
  PipeBackward(std::shared_ptr<PipeRun> run, size_t stream_leaves);

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "gpipe::PipeBackward"; }
  void release_variables() override;

 private:
  std::shared_ptr<PipeRun> run_;
  size_t stream_leaves_;
};

/// Edges to one stream leaf per accelerator device in `devices` (CPU ones
/// and repeats skipped), each made under that device's default stream.
torch::autograd::edge_list stream_leaf_edges(const std::vector<c10::Device>& devices);

}  // namespace gpipe::detail
