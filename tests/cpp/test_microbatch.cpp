// test_microbatch.cpp — scatter along each value's batch dim into near-equal pieces, gather back in order, grads alike.
#include "../../csrc/microbatch.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

using gpipe::detail::Batch;
using gpipe::detail::BatchDims;
using gpipe::detail::cut_grad;
using gpipe::detail::gather;
using gpipe::detail::join_grads;
using gpipe::detail::microbatch_sizes;
using gpipe::detail::scatter;
using gpipe::detail::ValueCut;
using Catch::Contains;

namespace {

std::vector<int64_t> rows_of(const std::vector<Batch>& microbatches, int64_t dim = 0) {
  std::vector<int64_t> rows;
  for (const auto& mb : microbatches) rows.push_back(mb[0].size(dim));
  return rows;
}

}  // namespace

TEST_CASE("microbatch: even split and gather round trip", "[microbatch]") {
  auto x = torch::arange(24, torch::kFloat64).reshape({8, 3});
  auto parts = scatter(Batch(x), 4).microbatches;
  REQUIRE(parts.size() == 4);
  CHECK(rows_of(parts) == std::vector<int64_t>{2, 2, 2, 2});
  CHECK(parts[1][0].equal(x.slice(0, 2, 4)));
  CHECK(gather(parts)[0].equal(x));
}

TEST_CASE("microbatch: an uneven batch makes chunks pieces differing by at most one row",
          "[microbatch]") {
  CHECK(microbatch_sizes(10, 4) == std::vector<int64_t>{3, 3, 2, 2});
  // at::chunk would give 9 pieces of 2, 2, ..., 1.
  auto sizes = microbatch_sizes(17, 16);
  CHECK(sizes.size() == 16);
  CHECK(sizes.front() == 2);
  CHECK(sizes.back() == 1);
  CHECK(microbatch_sizes(0, 4) == std::vector<int64_t>{0});
  auto x = torch::arange(10, torch::kFloat64).reshape({10, 1});
  auto parts = scatter(Batch(x), 4).microbatches;
  CHECK(rows_of(parts) == std::vector<int64_t>{3, 3, 2, 2});
  CHECK(gather(parts)[0].equal(x));
}

TEST_CASE("microbatch: fewer rows than chunks gives one row per micro-batch", "[microbatch]") {
  auto x = torch::ones({3, 2});
  auto parts = scatter(Batch(x), 8).microbatches;
  CHECK(rows_of(parts) == std::vector<int64_t>{1, 1, 1});
}

TEST_CASE("microbatch: a 0-row batch is one empty micro-batch", "[microbatch]") {
  auto x = torch::ones({0, 3});
  auto parts = scatter(Batch(x), 4).microbatches;
  REQUIRE(parts.size() == 1);
  CHECK(parts[0][0].sizes() == x.sizes());
}

TEST_CASE("microbatch: several tensors are cut alike", "[microbatch]") {
  auto a = torch::arange(6).reshape({6, 1});
  auto b = torch::arange(12).reshape({6, 2});
  auto parts = scatter(Batch({a, b}, false), 3).microbatches;
  REQUIRE(parts.size() == 3);
  for (const auto& p : parts) {
    CHECK_FALSE(p.atomic);
    REQUIRE(p.size() == 2);
    CHECK(p[0].size(0) == 2);
    CHECK(p[1].size(0) == 2);
  }
  auto back = gather(parts);
  CHECK(back[0].equal(a));
  CHECK(back[1].equal(b));
}

TEST_CASE("microbatch: batch dims per value, and values that are not cut", "[microbatch]") {
  auto seq_first = torch::arange(24, torch::kFloat64).reshape({2, 6, 2});  // [seq, batch, feat]
  auto mask = torch::ones({2, 2});
  auto scattered = scatter(Batch({seq_first, mask}, false), 3, BatchDims{1, std::nullopt});
  const auto& parts = scattered.microbatches;
  REQUIRE(parts.size() == 3);
  for (size_t i = 0; i < parts.size(); ++i) {
    CHECK(parts[i][0].equal(seq_first.slice(1, 2 * i, 2 * i + 2)));
    CHECK(parts[i][1].is_same(mask));
  }
  CHECK(scattered.cuts[0].dim == 1);
  CHECK_FALSE(scattered.cuts[1].dim.has_value());
  // Gathered along dim 1 (a negative dim counts from the end), the mask from micro-batch 0.
  std::vector<ValueCut> cuts;
  auto back = gather(parts, BatchDims{-2, std::nullopt}, &cuts);
  CHECK(back[0].equal(seq_first));
  CHECK(back[1].is_same(mask));
  CHECK(cuts[0].dim == 1);
  CHECK(cuts[0].sizes == std::vector<int64_t>{2, 2, 2});
}

TEST_CASE("microbatch: outputs keep their own sizes", "[microbatch]") {
  std::vector<Batch> outputs;
  for (int64_t rows : {2, 1}) {
    auto x = torch::ones({rows, 3});
    outputs.emplace_back(std::vector<torch::Tensor>{x, x.repeat({2, 1})}, false);
  }
  std::vector<ValueCut> cuts;
  auto out = gather(outputs, BatchDims{0}, &cuts);
  CHECK(out[0].size(0) == 3);
  CHECK(out[1].size(0) == 6);
  CHECK(cuts[1].sizes == std::vector<int64_t>{4, 2});
  auto pieces = cut_grad(torch::arange(6, torch::kFloat64).reshape({6, 1}), cuts[1], 2);
  REQUIRE(pieces.size() == 2);
  CHECK(pieces[0].size(0) == 4);
  CHECK(pieces[1].size(0) == 2);
}

TEST_CASE("microbatch: grads are joined like their values were cut", "[microbatch]") {
  ValueCut along1{1, {2, 1}};
  auto g = join_grads({torch::ones({4, 2}), torch::Tensor()}, along1);
  CHECK(g.sizes() == torch::IntArrayRef({4, 3}));
  CHECK(g.slice(1, 2, 3).abs().sum().item<double>() == 0.0);
  // A shared value's grad is the sum of every micro-batch's.
  ValueCut shared;
  auto s = join_grads({torch::full({2}, 1.0), torch::full({2}, 2.0), torch::Tensor()}, shared);
  CHECK(s.equal(torch::full({2}, 3.0)));
  auto pieces = cut_grad(torch::ones({2}), shared, 3);
  CHECK(pieces[0].defined());
  CHECK_FALSE(pieces[1].defined());
  CHECK_FALSE(pieces[2].defined());
}

TEST_CASE("microbatch: bad inputs are named", "[microbatch]") {
  CHECK_THROWS_WITH(scatter(Batch(torch::tensor(1.0)), 2),
                    Contains("0-dimensional") && Contains("chunks=1"));
  CHECK_NOTHROW(scatter(Batch(torch::tensor(1.0)), 1));
  CHECK_THROWS_WITH(scatter(Batch({torch::ones({4}), torch::ones({5})}, false), 2),
                    Contains("input 1 has 5 rows along dim 0 but input 0 has 4"));
  CHECK_THROWS_WITH(scatter(Batch(torch::ones({4})), 0), Contains("got 0"));
  CHECK_THROWS_WITH(scatter(Batch(torch::ones({4, 2})), 2, BatchDims{2}),
                    Contains("batch_dim 2 is out of range for input 0"));
  CHECK_THROWS_WITH(scatter(Batch({torch::ones({4}), torch::ones({4})}, false), 2,
                            BatchDims{0, 0, 0}),
                    Contains("batch_dim has 3 entries but the input has 2 values"));
  std::vector<Batch> scalars{Batch(torch::tensor(1.0)), Batch(torch::tensor(2.0))};
  CHECK_THROWS_WITH(gather(scalars), Contains("output 0 of micro-batch 0 is 0-dimensional"));
  CHECK(gather(scalars, BatchDims{std::nullopt})[0].item<double>() == 1.0);
}
