// test_microbatch.cpp — scatter along dim 0 like at::chunk, gather back in order.
#include "../../csrc/microbatch.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

using gpipe::detail::Batch;
using gpipe::detail::gather;
using gpipe::detail::rows_of;
using gpipe::detail::scatter;

TEST_CASE("microbatch: even split and gather round trip", "[microbatch]") {
  auto x = torch::arange(24, torch::kFloat64).reshape({8, 3});
  auto parts = scatter(Batch(x), 4);
  REQUIRE(parts.size() == 4);
  CHECK(rows_of(parts) == std::vector<int64_t>{2, 2, 2, 2});
  CHECK(parts[1][0].equal(x.slice(0, 2, 4)));
  CHECK(gather(parts)[0].equal(x));
}

TEST_CASE("microbatch: uneven last piece", "[microbatch]") {
  auto x = torch::arange(10, torch::kFloat64).reshape({10, 1});
  auto parts = scatter(Batch(x), 4);
  CHECK(rows_of(parts) == std::vector<int64_t>{3, 3, 3, 1});
  CHECK(gather(parts)[0].equal(x));
}

TEST_CASE("microbatch: fewer rows than chunks gives fewer micro-batches", "[microbatch]") {
  auto x = torch::ones({3, 2});
  auto parts = scatter(Batch(x), 8);
  CHECK(rows_of(parts) == std::vector<int64_t>{1, 1, 1});
}

TEST_CASE("microbatch: several tensors are cut alike", "[microbatch]") {
  auto a = torch::arange(6).reshape({6, 1});
  auto b = torch::arange(12).reshape({6, 2});
  auto parts = scatter(Batch({a, b}, false), 3);
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

TEST_CASE("microbatch: bad inputs are named", "[microbatch]") {
  CHECK_THROWS_WITH(scatter(Batch(torch::tensor(1.0)), 2), Catch::Contains("0-dimensional"));
  CHECK_THROWS_WITH(scatter(Batch({torch::ones({4}), torch::ones({5})}, false), 2),
                    Catch::Contains("input 1 has 5 rows but input 0 has 4"));
  CHECK_THROWS_WITH(scatter(Batch(torch::ones({4})), 0), Catch::Contains("got 0"));
  CHECK_THROWS_WITH(scatter(Batch(torch::ones({0, 3})), 2), Catch::Contains("0 rows"));
}
