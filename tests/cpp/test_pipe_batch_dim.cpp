// test_pipe_batch_dim.cpp — where a batch is cut (batch_dim), values not cut, outputs of their own sizes, edge batches, a Pipe inside a Sequential.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <optional>
#include <vector>

using Catch::Contains;
using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::check_param_grads;
using gpipe_test::deep_copy;
using gpipe_test::kTolerance;
using gpipe_test::max_abs_diff;
using gpipe_test::randn64;

namespace {

// Mixes along dim 0, the sequence of a sequence-first [seq, batch, features]
// batch: a running sum over positions, then a linear map of the features.
class SeqMixImpl : public torch::nn::Cloneable<SeqMixImpl> {
 public:
  SeqMixImpl() { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(linear(x.cumsum(0))); }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(SeqMix);

torch::nn::Sequential seq_first_model() {
  torch::manual_seed(3);
  torch::nn::Sequential model(SeqMix(), SeqMix(), torch::nn::Linear(4, 2));
  model->to(torch::kFloat64);
  return model;
}

// [x, table] -> x @ table: `table` is shared by every row.
class LookupImpl : public torch::nn::Cloneable<LookupImpl> {
 public:
  void reset() override {}
  torch::Tensor forward(std::vector<torch::Tensor> xs) { return xs.at(0).matmul(xs.at(1)); }
};
TORCH_MODULE(Lookup);

// x -> [x, x repeated twice along dim 0]: outputs with different row counts.
class TwoSizesImpl : public torch::nn::Cloneable<TwoSizesImpl> {
 public:
  void reset() override {}
  std::vector<torch::Tensor> forward(const torch::Tensor& x) { return {x, x.repeat({2, 1})}; }
};
TORCH_MODULE(TwoSizes);

// x -> a 0-dimensional value.
class TotalImpl : public torch::nn::Cloneable<TotalImpl> {
 public:
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return x.pow(2).sum(); }
};
TORCH_MODULE(Total);

// [x, mask] -> [x * mask, mask]: the mask passes through every micro-batch.
class MaskedImpl : public torch::nn::Cloneable<MaskedImpl> {
 public:
  void reset() override {}
  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> xs) {
    return {xs.at(0) * xs.at(1), xs.at(1)};
  }
};
TORCH_MODULE(Masked);

}  // namespace

TEST_CASE("batch_dim: a sequence-first model cut along dim 1 equals the Sequential",
          "[batch_dim]") {
  for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    INFO("checkpoint " << mode);
    auto model = seq_first_model();
    auto ref = deep_copy(model);
    gpipe::Pipe pipe(model, PipeOptions().balance({1, 2}).chunks(3).checkpoint(mode).batch_dim(1));
    const auto x = randn64({5, 6, 4});  // 5 positions, 6 sequences
    auto xp = x.clone().requires_grad_(true);
    auto xr = x.clone().requires_grad_(true);
    auto out = pipe->forward(xp);
    auto want = ref->forward(xr);
    CHECK(max_abs_diff(out, want) <= kTolerance);
    const auto w = randn64(want.sizes().vec());
    (out * w).sum().backward();
    (want * w).sum().backward();
    CHECK(max_abs_diff(xp.grad(), xr.grad()) <= kTolerance);
    check_param_grads(*pipe, *ref);
  }
}

TEST_CASE("batch_dim: cutting a sequence-first batch along dim 0 is what goes wrong",
          "[batch_dim]") {
  // The reason for the option: dim 0 (the default) cuts the sequence, and
  // the running sum no longer sees earlier positions.
  auto model = seq_first_model();
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2}).chunks(3));
  const auto x = randn64({6, 6, 4});
  CHECK(max_abs_diff(pipe->forward(x), ref->forward(x)) > 1e-3);
}

TEST_CASE("batch_dim: a value that is not cut reaches every micro-batch, its grad is summed",
          "[batch_dim]") {
  torch::manual_seed(4);
  torch::nn::Sequential model(Lookup(), torch::nn::Linear(3, 2));
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(4).batch_dim({0, std::nullopt}));
  const auto x = randn64({7, 5});
  const auto table = randn64({5, 3});
  auto tp = table.clone().requires_grad_(true);
  auto tr = table.clone().requires_grad_(true);
  auto out = pipe->forward_tuple({x, tp});
  auto want = ref->forward(std::vector<torch::Tensor>{x, tr});
  REQUIRE(out.size() == 1);
  CHECK(max_abs_diff(out[0], want) <= kTolerance);
  out[0].pow(2).sum().backward();
  want.pow(2).sum().backward();
  CHECK(max_abs_diff(tp.grad(), tr.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
}

TEST_CASE("batch_dim: outputs keep their own row counts, forward and backward", "[batch_dim]") {
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(3, 3), TwoSizes());
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}).chunks(3));
  const auto x = randn64({7, 3});
  auto out = pipe->forward_tuple(x);
  auto want = ref->forward<std::vector<torch::Tensor>>(x);
  REQUIRE(out.size() == 2);
  CHECK(out[1].size(0) == 14);
  // Joined micro-batch by micro-batch: each micro-batch's repeat in turn.
  std::vector<torch::Tensor> expected_rows;
  for (const auto& p : want[0].tensor_split(3)) expected_rows.push_back(p.repeat({2, 1}));
  CHECK(max_abs_diff(out[0], want[0]) <= kTolerance);
  CHECK(max_abs_diff(out[1], torch::cat(expected_rows)) <= kTolerance);
  const auto w0 = randn64(want[0].sizes().vec());
  ((out[0] * w0).sum() + out[1].pow(2).sum()).backward();
  ((want[0] * w0).sum() + want[1].pow(2).sum()).backward();
  check_param_grads(*pipe, *ref);
}

TEST_CASE("batch_dim: a 0-dimensional output with chunks=1, a 0-row batch with chunks > 1",
          "[batch_dim]") {
  torch::manual_seed(6);
  {
    torch::nn::Sequential model(torch::nn::Linear(3, 3), Total());
    model->to(torch::kFloat64);
    auto ref = deep_copy(model);
    gpipe::Pipe pipe(model, PipeOptions().balance({1, 1}));
    const auto x = randn64({4, 3});
    auto out = pipe->forward(x);
    auto want = ref->forward(x);
    CHECK(out.dim() == 0);
    CHECK(max_abs_diff(out, want) <= kTolerance);
    out.backward();
    want.backward();
    check_param_grads(*pipe, *ref);
    gpipe::Pipe split(deep_copy(model), PipeOptions().balance({1, 1}).chunks(2));
    CHECK_THROWS_WITH(split->forward(x), Contains("0-dimensional") && Contains("after the Pipe"));
  }
  {
    auto model = gpipe_test::deep_copy(seq_first_model());
    auto ref = deep_copy(model);
    gpipe::Pipe pipe(model, PipeOptions().balance({2, 1}).chunks(4));
    const auto x = randn64({0, 3, 4});
    auto out = pipe->forward(x);
    CHECK(out.sizes() == ref->forward(x).sizes());
  }
}

TEST_CASE("batch_dim: an output not joined comes from micro-batch 0", "[batch_dim]") {
  torch::nn::Sequential model{Masked()};
  gpipe::Pipe pipe(model, PipeOptions().balance({1}).chunks(2).batch_dim({1, std::nullopt})
                              .output_batch_dim({1, std::nullopt}));
  const auto x = randn64({2, 4});
  const auto mask = randn64({2, 1});
  auto out = pipe->forward_tuple({x, mask});
  CHECK(max_abs_diff(out[0], x * mask) <= kTolerance);
  CHECK(out[1].equal(mask));
}

TEST_CASE("batch_dim: a Pipe is one module in a Sequential or an AnyModule (one forward)",
          "[batch_dim]") {
  torch::manual_seed(7);
  torch::nn::Sequential inner(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 4));
  inner->to(torch::kFloat64);
  auto ref_inner = deep_copy(inner);
  torch::nn::Linear first(3, 4);
  torch::nn::Linear last(4, 1);
  first->to(torch::kFloat64);
  last->to(torch::kFloat64);
  auto ref_first = std::dynamic_pointer_cast<torch::nn::LinearImpl>(first->clone());
  auto ref_last = std::dynamic_pointer_cast<torch::nn::LinearImpl>(last->clone());
  gpipe::Pipe pipe(inner, PipeOptions().balance({2, 1}).chunks(2));
  torch::nn::Sequential model(first, pipe, last);
  const auto x = randn64({6, 3});
  auto out = model->forward(x);
  auto want = ref_last->forward(ref_inner->forward(ref_first->forward(x)));
  CHECK(max_abs_diff(out, want) <= kTolerance);
  torch::nn::AnyModule any(pipe);
  const auto h = randn64({4, 4});
  CHECK(max_abs_diff(any.forward(h), ref_inner->forward(h)) <= kTolerance);
}

TEST_CASE("batch_dim: bad batch dims are named with the fix", "[batch_dim]") {
  auto model = seq_first_model();
  gpipe::Pipe pipe(model, PipeOptions().balance({1, 2}).chunks(2).batch_dim(3));
  CHECK_THROWS_WITH(pipe->forward(randn64({2, 2, 4})),
                    Contains("batch_dim 3 is out of range for input 0") && Contains("[-3, 3)"));
  gpipe::Pipe three(deep_copy(model),
                    PipeOptions().balance({1, 2}).chunks(2).batch_dim({0, 0, 0}));
  CHECK_THROWS_WITH(three->forward(randn64({2, 2, 4})),
                    Contains("batch_dim has 3 entries but the input has 1 values"));
}
