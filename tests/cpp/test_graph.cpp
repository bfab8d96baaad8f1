// test_graph.cpp — a cell's external edges: parameters, outside tensors, never the cell's own nodes or input leaves.
#include "graph.h"

#include <catch2/catch.hpp>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <thread>

using gpipe::detail::EdgeIndex;
using gpipe::detail::cut_at_externals;
using gpipe::detail::GraphWindow;
using torch::autograd::impl::gradient_edge;

TEST_CASE("external edges lead to parameters and to tensors made before the cell, once each") {
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

  const auto cut = cut_at_externals({out}, window, {leaf});
  EdgeIndex index;
  for (const auto& e : cut.externals) index.add(e);
  REQUIRE(cut.externals.size() == 2);
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
  const auto cut = cut_at_externals({weight}, window, {});
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
  const auto cut = cut_at_externals({out}, window, {leaf});
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
    CHECK(cut_at_externals({out}, window, {leaf}).devices.empty());
  }
  {
    GraphWindow window;
    auto out = leaf.matmul(weight).to(at::kMeta) * 2;  // a node on the meta device
    window.close();
    const auto cut = cut_at_externals({out}, window, {leaf});
    REQUIRE(cut.devices.size() == 1);
    CHECK(cut.devices[0] == c10::Device(at::kMeta));
  }
  {
    // A capture node stands in for an outside tensor on that device.
    auto far = torch::randn({3}, torch::TensorOptions().device(at::kMeta).requires_grad(true));
    GraphWindow window;
    auto out = leaf.to(at::kMeta) + far;
    window.close();
    const auto cut = cut_at_externals({out}, window, {leaf});
    CHECK(cut.devices == std::vector<c10::Device>{c10::Device(at::kMeta)});
  }
}
