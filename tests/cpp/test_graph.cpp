// test_graph.cpp — a cell's external edges: parameters, outside tensors, never the cell's own nodes or input leaves.
#include "graph.h"
#include "split.h"

#include <catch2/catch.hpp>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <thread>
#include <vector>

using gpipe::detail::EdgeIndex;
using gpipe::detail::cut_at_externals;
using gpipe::detail::GraphWindow;
using torch::autograd::impl::gradient_edge;

namespace {

// Where `leaf`'s grad ends: the node a cut stops at.
const torch::autograd::Node* node_of(const torch::Tensor& leaf) {
  return gradient_edge(leaf).function.get();
}

}  // namespace

TEST_CASE("external edges lead to parameters and to tensors made before the cell, once each") {
  const bool share = GENERATE(false, true);
  INFO("share_small " << share);
  auto weight = torch::randn({3, 3}, torch::requires_grad());
  auto base = torch::randn({3, 3}, torch::requires_grad());
  auto outside = base * 2;  // a non-leaf made before the cell: its grad_fn is outside
  auto leaf = torch::randn({2, 3}, torch::requires_grad());

  GraphWindow window;
  auto h = leaf.matmul(weight).tanh();
  auto out = h.matmul(outside) + h.matmul(weight);  // weight reached twice
  window.close();
  // Before the cut redirects the edges: what plain autograd says.
  const auto want = torch::autograd::grad({out.sum()}, {weight, outside}, {}, true);

  const auto cut = cut_at_externals({out}, window, {node_of(leaf)}, share);
  EdgeIndex index;
  for (const auto& e : cut.externals) index.add(e);
  REQUIRE(cut.externals.size() == 2);
  // Two small grads: one node with two inputs when shared, else one each.
  CHECK((cut.capture_nodes[0] == cut.capture_nodes[1]) == share);
  CHECK(cut.captures[1].input_nr == (share ? 1U : 0U));
  CHECK(index.find(gradient_edge(weight)) >= 0);
  CHECK(index.find(gradient_edge(outside)) >= 0);
  CHECK(index.find(gradient_edge(leaf)) == -1);
  CHECK(index.find(gradient_edge(base)) == -1);  // behind `outside`: not this cell's business
  CHECK(cut.direct == std::vector<int64_t>{-1});

  // The grads arriving at the capture nodes are the outside tensors' grads,
  // and nothing reaches any .grad.
  const auto got = torch::autograd::Engine::get_default_engine().execute(
      {gradient_edge(out)}, {torch::ones_like(out)}, true, false, false,
      {cut.captures[index.find(gradient_edge(weight))], cut.captures[index.find(gradient_edge(outside))]});
  CHECK(torch::allclose(got[0], want[0]));
  CHECK(torch::allclose(got[1], want[1]));
  CHECK_FALSE(weight.grad().defined());
}

TEST_CASE("an output that is an outside tensor itself is an external edge") {
  auto weight = torch::randn({3}, torch::requires_grad());
  GraphWindow window;
  window.close();
  const auto cut = cut_at_externals({weight}, window, {}, /*share_small=*/true);
  REQUIRE(cut.externals.size() == 1);
  CHECK(cut.externals[0].function == gradient_edge(weight).function);
  CHECK(cut.direct == std::vector<int64_t>{0});
  CHECK_FALSE(cut.captures[0].is_valid());
}

TEST_CASE("nodes made on another thread during the window are outside") {
  auto leaf = torch::randn({2}, torch::requires_grad());
  GraphWindow window;
  torch::Tensor other;
  std::thread([&] { other = leaf * 3; }).join();
  auto out = other.exp();
  window.close();
  const auto cut = cut_at_externals({out}, window, {node_of(leaf)}, /*share_small=*/true);
  REQUIRE(cut.externals.size() == 1);
  CHECK(cut.externals[0].function == other.grad_fn());
}

TEST_CASE("a cut names the non-CPU devices its nodes take grads on (the deadlock rule's input)") {
  // The meta device stands in for an accelerator here: its nodes would run
  // on that device's engine thread.
  auto leaf = torch::randn({2, 3}, torch::requires_grad());
  auto weight = torch::randn({3, 3}, torch::requires_grad());
  {
    GraphWindow window;
    auto out = leaf.matmul(weight).tanh();
    window.close();
    CHECK(cut_at_externals({out}, window, {node_of(leaf)}, true).devices.empty());
  }
  {
    GraphWindow window;
    auto out = leaf.matmul(weight).to(at::kMeta) * 2;  // a node on the meta device
    window.close();
    const auto cut = cut_at_externals({out}, window, {node_of(leaf)}, true);
    REQUIRE(cut.devices.size() == 1);
    CHECK(cut.devices[0] == c10::Device(at::kMeta));
  }
  {
    // A capture node stands in for an outside tensor on that device.
    auto far = torch::randn({3}, torch::TensorOptions().device(at::kMeta).requires_grad(true));
    GraphWindow window;
    auto out = leaf.to(at::kMeta) + far;
    window.close();
    const auto cut = cut_at_externals({out}, window, {node_of(leaf)}, true);
    CHECK(cut.devices == std::vector<c10::Device>{c10::Device(at::kMeta)});
  }
}

TEST_CASE("small grads share a capture node per device, up to a node's bytes, larger ones get their own") {
  using gpipe::detail::kShareBytes;
  using gpipe::detail::kShareNodeBytes;
  auto leaf = torch::randn({2, 8}, torch::requires_grad());
  // 8 x 2048 floats: exactly kShareBytes each, so 16 fill one node.
  std::vector<torch::Tensor> smalls;
  for (int k = 0; k < 20; ++k) smalls.push_back(torch::randn({8, 2048}, torch::requires_grad()));
  REQUIRE(smalls[0].nbytes() == static_cast<size_t>(kShareBytes));
  auto big = torch::randn({8, 2049}, torch::requires_grad());  // just over
  auto meta = torch::randn({2}, torch::TensorOptions().device(at::kMeta).requires_grad(true));
  GraphWindow window;
  auto h = leaf.matmul(big).sum();
  for (const auto& s : smalls) h = h + leaf.matmul(s).sum();
  auto out = h;
  auto meta_out = leaf.to(at::kMeta).sum(1).mul(meta).sum();
  window.close();
  const auto cut = cut_at_externals({out, meta_out}, window, {node_of(leaf)}, /*share_small=*/true);
  EdgeIndex index;
  for (const auto& e : cut.externals) index.add(e);
  REQUIRE(cut.externals.size() == 22);
  auto node_of = [&](const torch::Tensor& t) {
    return cut.capture_nodes[static_cast<size_t>(index.find(gradient_edge(t)))];
  };
  CHECK(node_of(big)->num_inputs() == 1);
  CHECK(node_of(meta)->num_inputs() == 1);  // the only small one on its device
  CHECK(node_of(meta) != node_of(smalls[0]));
  const int64_t per_node = kShareNodeBytes / kShareBytes;
  // Reached in reverse order of the sum above; whichever came first fill a node.
  std::map<const void*, int64_t> inputs;
  for (const auto& s : smalls) ++inputs[node_of(s).get()];
  REQUIRE(inputs.size() == 2);
  std::vector<int64_t> counts;
  for (const auto& [node, n] : inputs) counts.push_back(n);
  std::sort(counts.begin(), counts.end());
  CHECK(counts == std::vector<int64_t>{20 - per_node, per_node});

  // The grads each input collects are that tensor's (capture mode, nothing
  // accumulated).
  torch::autograd::edge_list edges;
  std::vector<torch::Tensor> tensors{big, smalls[0], smalls[19]};
  for (const auto& t : tensors) edges.push_back(cut.captures[static_cast<size_t>(index.find(gradient_edge(t)))]);
  const auto got = torch::autograd::Engine::get_default_engine().execute(
      {gradient_edge(out)}, {torch::ones_like(out)}, true, false, false, edges);
  for (size_t k = 0; k < tensors.size(); ++k) {
    CHECK(torch::allclose(got[k], leaf.sum(0).unsqueeze(1).expand_as(tensors[k])));
  }
}

TEST_CASE("a cell whose small edges share a capture node is not split into I and W") {
  auto leaf = torch::randn({2, 3}, torch::requires_grad());
  auto w1 = torch::randn({3, 3}, torch::requires_grad());
  auto w2 = torch::randn({3, 3}, torch::requires_grad());
  for (const bool share : {false, true}) {
    INFO("share_small " << share);
    GraphWindow window;
    auto out = leaf.matmul(w1).tanh().matmul(w2);
    window.close();
    const auto cut = cut_at_externals({out}, window, {node_of(leaf)}, share);
    // Splittable as two frontier nodes when each edge has its own node; a
    // W run toward w2's input of a shared node would reach w1's path too.
    CHECK(gpipe::detail::split_weights({out}, {node_of(leaf)}, cut).splittable == !share);
  }
}

TEST_CASE("a small map finds every key before and after it outgrows its linear part") {
  gpipe::detail::SmallMap<int, int> map;
  const int n = static_cast<int>(3 * gpipe::detail::SmallMap<int, int>::kLinear);
  for (int k = 0; k < n; ++k) {
    const auto [value, added] = map.emplace(k, 10 * k);
    CHECK(added);
    CHECK(*value == 10 * k);
    // Present keys keep their first value.
    const auto [again, added_again] = map.emplace(k / 2, -1);
    CHECK_FALSE(added_again);
    CHECK(*again == 10 * (k / 2));
    for (int j = 0; j <= k; ++j) REQUIRE(map.find(j) != nullptr);
    CHECK(map.find(k + 1) == nullptr);
  }
  for (int k = 0; k < n; ++k) CHECK(*map.find(k) == 10 * k);
}
