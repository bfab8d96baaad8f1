// split.h — zero-bubble's split of a cell's backward into an input-grad pass (I) and a weight-grad pass (W).
//
// I back-propagates only toward the nodes where the cell's input grads end
// (its input sinks); W later computes what I skipped: the grads flowing
// into the capture nodes (parameters and other outside tensors, see
// graph.h). The nodes on a path to an input sink form the input path; a node of the input path with an edge leaving it
// (toward captures only) is a frontier node. I catches the grads arriving
// at each frontier node (a pre-hook); W runs each frontier node again from
// those grads, toward the captures its leaving edges reach:
//
//   out -> Addmm2 -> Relu -> Addmm1 -> input sink                   (input path: I)
//            |  `-> T -> capture(W2)                 `-> capture(b1), T -> capture(W1)
//            `-> capture(b2)                                        (frontier edges: W)
//
// The trap: a W run from frontier node n reaches, besides n's leaving
// edges, every node on a path from n to its targets; if one of n's
// input-path children leads to one of them (a weight used at two depths of
// one stage), that child would run again and its grads count twice. Such a
// cell is not split: its I runs the whole backward and its W does nothing.
// So is a cell whose frontier nodes carry hooks (they would fire twice).
#pragma once

#include "graph.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <vector>

namespace gpipe::detail {

/// The grads a frontier node received in I.
struct Caught {
  bool armed = false;
  torch::autograd::variable_list grads;
};

/// Where one W run starts and what it computes.
struct WeightRoot {
  /// A frontier node with the grads it caught in I, or (node null) an
  /// output whose graph leads to no input: it starts from the output's own
  /// edge with the output's grad.
  std::shared_ptr<torch::autograd::Node> node;
  std::shared_ptr<Caught> caught;
  int64_t output = -1;
  /// The numbers of the capture edges (`Cut::captures`) this run computes.
  std::vector<size_t> targets;
};

struct WeightSplit {
  /// False: run the whole backward in I (see above).
  bool splittable = false;
  std::vector<WeightRoot> roots;
};

/// Analyses the graph behind `outputs` (a cell's, cut by `cut`), whose
/// input grads wanted end in the nodes `inputs` (null where not wanted),
/// and hooks the frontier nodes to catch their grads while a `Caught` is
/// armed.
WeightSplit split_weights(const std::vector<at::Tensor>& outputs,
                          const std::vector<const torch::autograd::Node*>& inputs, const Cut& cut);

}  // namespace gpipe::detail
