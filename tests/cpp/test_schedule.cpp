// test_schedule.cpp — the GPipe schedule as pictures and tables (no torch involved).
#include "../../csrc/schedule.h"

#include <catch2/catch.hpp>

#include <stdexcept>

using gpipe::detail::Action;
using gpipe::detail::gpipe_backward;
using gpipe::detail::gpipe_forward;
using gpipe::detail::Phase;
using gpipe::detail::render;
using gpipe::detail::Schedule;
using gpipe::detail::serialize;
using gpipe::detail::simulate;

TEST_CASE("schedule: gpipe forward, 3 stages, 4 micro-batches", "[schedule]") {
  CHECK(render(gpipe_forward(3, 4)) ==
        "stage 0: F0 F1 F2 F3\n"
        "stage 1: .. F0 F1 F2 F3\n"
        "stage 2: .. .. F0 F1 F2 F3\n");
}

TEST_CASE("schedule: gpipe backward, 3 stages, 4 micro-batches", "[schedule]") {
  CHECK(render(gpipe_backward(3, 4)) ==
        "stage 0: .. .. B3 B2 B1 B0\n"
        "stage 1: .. B3 B2 B1 B0\n"
        "stage 2: B3 B2 B1 B0\n");
}

TEST_CASE("schedule: one stage and one micro-batch", "[schedule]") {
  CHECK(render(gpipe_forward(1, 1)) == "stage 0: F0\n");
  CHECK(render(gpipe_backward(1, 1)) == "stage 0: B0\n");
  CHECK(render(gpipe_forward(1, 3)) == "stage 0: F0 F1 F2\n");
  CHECK(render(gpipe_forward(3, 1)) ==
        "stage 0: F0\n"
        "stage 1: .. F0\n"
        "stage 2: .. .. F0\n");
}

TEST_CASE("schedule: wide micro-batch numbers keep columns aligned", "[schedule]") {
  CHECK(render(gpipe_forward(2, 11)) ==
        "stage 0: F0  F1  F2  F3  F4  F5  F6  F7  F8  F9  F10\n"
        "stage 1: ... F0  F1  F2  F3  F4  F5  F6  F7  F8  F9  F10\n");
}

TEST_CASE("schedule: action lists per stage", "[schedule]") {
  const Schedule f = gpipe_forward(2, 3);
  REQUIRE(f.stages.size() == 2);
  const std::vector<Action> forward{{Phase::Forward, 0}, {Phase::Forward, 1}, {Phase::Forward, 2}};
  CHECK(f.stages[0] == forward);
  CHECK(f.stages[1] == forward);
  const Schedule b = gpipe_backward(2, 3);
  const std::vector<Action> backward{
      {Phase::Backward, 2}, {Phase::Backward, 1}, {Phase::Backward, 0}};
  CHECK(b.stages[0] == backward);
  CHECK(b.stages[1] == backward);
}

TEST_CASE("schedule: fill-drain ticks, makespan M+K-1", "[schedule]") {
  const auto ticks = simulate(gpipe_forward(4, 8));
  REQUIRE(ticks.size() == 4);
  for (size_t j = 0; j < 4; ++j) {
    for (size_t i = 0; i < 8; ++i) CHECK(ticks[j][i] == static_cast<int64_t>(i + j));
  }
  CHECK(ticks[3][7] + 1 == 8 + 4 - 1);
}

TEST_CASE("schedule: serial order respects dependencies", "[schedule]") {
  const auto steps = serialize(gpipe_backward(3, 2));
  std::vector<std::pair<int64_t, int64_t>> order;  // (stage, micro-batch)
  for (const auto& s : steps) order.emplace_back(s.stage, s.action.microbatch);
  const std::vector<std::pair<int64_t, int64_t>> expected{{2, 1}, {1, 1}, {2, 0}, {0, 1},
                                                          {1, 0}, {0, 0}};
  CHECK(order == expected);
  const auto forward = serialize(gpipe_forward(2, 2));
  REQUIRE(forward.size() == 4);
  CHECK(forward[0].stage == 0);
  CHECK(forward[0].action.microbatch == 0);
  CHECK(forward[1].stage == 0);
  CHECK(forward[1].action.microbatch == 1);
  CHECK(forward[2].stage == 1);
  CHECK(forward[2].action.microbatch == 0);
}

TEST_CASE("schedule: one list holding both halves (a 1F1B-shaped schedule)", "[schedule]") {
  Schedule s;
  s.microbatches = 2;
  s.stages = {
      {{Phase::Forward, 0}, {Phase::Forward, 1}, {Phase::Backward, 0}, {Phase::Backward, 1}},
      {{Phase::Forward, 0}, {Phase::Backward, 0}, {Phase::Forward, 1}, {Phase::Backward, 1}},
  };
  CHECK(render(s) ==
        "stage 0: F0 F1 .. B0 .. B1\n"
        "stage 1: .. F0 B0 F1 B1\n");
}

TEST_CASE("schedule: a list that can never finish is refused", "[schedule]") {
  Schedule s;
  s.microbatches = 1;
  s.stages = {{{Phase::Forward, 0}}, {{Phase::Backward, 0}, {Phase::Forward, 0}}};
  CHECK_THROWS_AS(simulate(s), std::invalid_argument);
  CHECK_THROWS_AS(gpipe_forward(0, 4), std::invalid_argument);
  CHECK_THROWS_AS(gpipe_forward(2, 0), std::invalid_argument);
}
