// test_plan.cpp — the training-step plans as pictures, their validation and simulation (no torch).
#include "../../csrc/plan.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using gpipe::detail::Costs;
using gpipe::detail::describe;
using gpipe::detail::gpipe_plan;
using gpipe::detail::interleaved_1f1b_plan;
using gpipe::detail::make_plan;
using gpipe::detail::one_f_one_b_plan;
using gpipe::detail::Op;
using gpipe::detail::Plan;
using gpipe::detail::PlanKind;
using gpipe::detail::plan_from_csv;
using gpipe::detail::plan_to_csv;
using gpipe::detail::render;
using gpipe::detail::require_runnable_placement;
using gpipe::detail::v_placed;
using gpipe::detail::simulate;
using gpipe::detail::Simulation;
using gpipe::detail::Task;
using gpipe::detail::to_string;
using gpipe::detail::validate;
using gpipe::detail::v_placement;
using gpipe::detail::zb_h1_plan;
using gpipe::detail::zb_v_plan;
using Catch::Matchers::Contains;

namespace {

// A hand-made plan with one stage per worker.
Plan hand_made(int64_t microbatches, std::vector<std::vector<Task>> lists) {
  Plan plan;
  plan.kind = PlanKind::OneFOneB;
  plan.workers = static_cast<int64_t>(lists.size());
  plan.stages = plan.workers;
  plan.microbatches = microbatches;
  plan.lists = std::move(lists);
  return plan;
}

Task F(int64_t s, int64_t i) { return {Op::F, s, i}; }
Task B(int64_t s, int64_t i) { return {Op::B, s, i}; }
Task I(int64_t s, int64_t i) { return {Op::I, s, i}; }
Task W(int64_t s, int64_t i) { return {Op::W, s, i}; }

// The efficiency of a simulated step against a pipeline with no bubble.
double efficiency(const Plan& plan, const Simulation& sim) {
  return sim.work / (static_cast<double>(plan.workers) * sim.makespan);
}

}  // namespace

TEST_CASE("plan: gpipe, 3 workers, 4 micro-batches", "[plan]") {
  CHECK(render(gpipe_plan(3, 4)) ==
        "worker 0: F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0\n"
        "worker 1: .. F0 F1 F2 F3 .. .. B3 B2 B1 B0\n"
        "worker 2: .. .. F0 F1 F2 F3 B3 B2 B1 B0\n");
}

TEST_CASE("plan: 1f1b, 3 workers, 4 micro-batches", "[plan]") {
  // Warm-up of W-w-1 forwards (2, 1, 0), then F and B in turn, then the
  // backwards left over.
  CHECK(render(one_f_one_b_plan(3, 4)) ==
        "worker 0: F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3\n"
        "worker 1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3\n"
        "worker 2: .. .. F0 B0 F1 B1 F2 B2 F3 B3\n");
}

TEST_CASE("plan: 1f1b, 4 workers, 8 micro-batches (the picture in plan.h)", "[plan]") {
  CHECK(render(one_f_one_b_plan(4, 8)) ==
        "worker 0: F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7\n"
        "worker 1: .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7\n"
        "worker 2: .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7\n"
        "worker 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n");
}

TEST_CASE("plan: 1f1b with fewer micro-batches than workers warms up with all of them", "[plan]") {
  CHECK(render(one_f_one_b_plan(4, 2)) ==
        "worker 0: F0 F1 .. .. .. .. .. B0 .. B1\n"
        "worker 1: .. F0 F1 .. .. .. B0 .. B1\n"
        "worker 2: .. .. F0 F1 .. B0 .. B1\n"
        "worker 3: .. .. .. F0 B0 F1 B1\n");
}

TEST_CASE("plan: interleaved 1f1b, 2 workers, 2 stages each, 4 micro-batches", "[plan]") {
  // Worker 0 owns stages 0 and 2, worker 1 stages 1 and 3. Micro-batches go
  // in groups of 2 through local stage 0, then 1; backwards mirror that.
  // Warm-up 2(W-w-1) + (v-1)W: 4 on worker 0, 2 on worker 1.
  CHECK(render(interleaved_1f1b_plan(2, 2, 4)) ==
        "worker 0: F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 .... B2.2 .... "
        "B3.2 B2.0 B3.0\n"
        "worker 1: .... F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 "
        "B2.1 B3.1\n");
}

TEST_CASE("plan: interleaved 1f1b, micro-batches not a multiple of workers", "[plan]") {
  // 5 micro-batches on 2 workers: groups {0, 1} and {2, 3, 4} (the remainder
  // joins the last group), so the warm-up counts the larger group:
  // 2(W-w-1) + (v-1)*3 = 5 on worker 0, 3 on worker 1.
  CHECK(render(interleaved_1f1b_plan(2, 2, 5)) ==
        "worker 0: F0.0 F1.0 F0.2 F1.2 F2.0 F3.0 B0.2 F4.0 B1.2 F2.2 B0.0 F3.2 B1.0 F4.2 B2.2 "
        ".... B3.2 .... B4.2 B2.0 B3.0 B4.0\n"
        "worker 1: .... F0.1 F1.1 F0.3 F1.3 B0.3 F2.1 B1.3 F3.1 B0.1 F4.1 B1.1 F2.3 B2.3 F3.3 "
        "B3.3 F4.3 B4.3 B2.1 B3.1 B4.1\n");
}

TEST_CASE("plan: interleaved 1f1b with one stage per worker is 1f1b", "[plan]") {
  for (int64_t w = 1; w <= 5; ++w) {
    for (int64_t m = 1; m <= 9; ++m) {
      CHECK(interleaved_1f1b_plan(w, 1, m).lists == one_f_one_b_plan(w, m).lists);
    }
  }
}

TEST_CASE("plan: zb-h1, 3 workers, 6 micro-batches", "[plan]") {
  // 1F1B's F's and I's in 1F1B's order. Worker 0 holds 3 micro-batches (F
  // until W) after its warm-up, 1F1B's peak, so each W follows its I; worker
  // 2 may hold 3 too, so its W0 waits until F2 I2 and its last W's fill the
  // drain, where worker 0's I's come back two ticks apart instead of three.
  // Every worker idles 2 = W - 1 ticks: 3M + (W - 1).
  CHECK(render(zb_h1_plan(3, 6)) ==
        "worker 0: F0 F1 F2 .. .. I0 W0 F3 I1 W1 F4 I2 W2 F5 I3 W3 I4 W4 I5 W5\n"
        "worker 1: .. F0 F1 .. I0 F2 I1 W0 F3 I2 W1 F4 I3 W2 F5 I4 W3 I5 W4 W5\n"
        "worker 2: .. .. F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 F4 I4 W2 F5 I5 W3 W4 W5\n");
}

TEST_CASE("plan: zb-h1, 4 workers, 8 micro-batches", "[plan]") {
  // W's run when the budget (4 in flight) is full (worker 3's W0), where the
  // next F has not arrived (worker 1's W0, worker 2's W0), and in the drain.
  CHECK(render(zb_h1_plan(4, 8)) ==
        "worker 0: F0 F1 F2 F3 .. .. .. I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 "
        "W7\n"
        "worker 1: .. F0 F1 F2 .. .. I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 "
        "W7\n"
        "worker 2: .. .. F0 F1 .. I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 "
        "W7\n"
        "worker 3: .. .. .. F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 "
        "W7\n");
}

TEST_CASE("plan: zb-h1 with fewer micro-batches than workers", "[plan]") {
  // Nothing to fill the bubbles with but the W's: 2(M + W) - 1 ticks.
  CHECK(render(zb_h1_plan(4, 2)) ==
        "worker 0: F0 F1 .. .. .. .. .. I0 W0 I1 W1\n"
        "worker 1: .. F0 F1 .. .. .. I0 W0 I1 W1\n"
        "worker 2: .. .. F0 F1 .. I0 W0 I1 W1\n"
        "worker 3: .. .. .. F0 I0 F1 I1 W0 W1\n");
}

TEST_CASE("plan: small and wide pictures", "[plan]") {
  CHECK(render(gpipe_plan(1, 1)) == "worker 0: F0 B0\n");
  CHECK(render(zb_h1_plan(1, 2)) == "worker 0: F0 I0 W0 F1 I1 W1\n");
  CHECK(render(gpipe_plan(2, 11)) ==
        "worker 0: F0  F1  F2  F3  F4  F5  F6  F7  F8  F9  F10 ... ... B10 B9  B8  B7  B6  B5  "
        "B4  B3  B2  B1  B0\n"
        "worker 1: ... F0  F1  F2  F3  F4  F5  F6  F7  F8  F9  F10 B10 B9  B8  B7  B6  B5  B4  "
        "B3  B2  B1  B0\n");
}

TEST_CASE("plan: every generated plan validates", "[plan]") {
  for (int64_t w = 1; w <= 8; ++w) {
    for (int64_t m = 1; m <= 40; ++m) {
      CAPTURE(w, m);
      CHECK_NOTHROW(validate(gpipe_plan(w, m)));
      CHECK_NOTHROW(validate(one_f_one_b_plan(w, m)));
      CHECK_NOTHROW(validate(zb_h1_plan(w, m)));
      for (int64_t v = 1; v <= 4; ++v) {
        CAPTURE(v);
        const Plan plan = interleaved_1f1b_plan(w, v, m);
        CHECK(plan.stages == v * w);
        CHECK_NOTHROW(validate(plan));
      }
    }
  }
}

TEST_CASE("plan: validate names the cycle of a deadlocking plan", "[plan]") {
  // Worker 0 waits at B0 for worker 1's B0; worker 1 runs F1 first, which
  // waits for worker 0's F1, queued behind that B0.
  const Plan plan = hand_made(2, {{F(0, 0), B(0, 0), F(0, 1), B(0, 1)},
                                  {F(1, 1), F(1, 0), B(1, 0), B(1, 1)}});
  CHECK_THROWS_WITH(validate(plan),
                    Contains("deadlocks") &&
                        Contains("worker 0 at B(stage 0, micro-batch 0) for B(stage 1, "
                                 "micro-batch 0) (worker 1)") &&
                        Contains("worker 1 at F(stage 1, micro-batch 1) for F(stage 0, "
                                 "micro-batch 1) (worker 0)"));
  CHECK_THROWS_AS(simulate(plan), std::invalid_argument);
  CHECK_THROWS_AS(render(plan), std::invalid_argument);
}

TEST_CASE("plan: validate refuses W before its I", "[plan]") {
  const Plan plan = hand_made(1, {{F(0, 0), W(0, 0), I(0, 0)}});
  CHECK_THROWS_WITH(validate(plan), Contains("worker 0 at W(stage 0, micro-batch 0) for "
                                             "I(stage 0, micro-batch 0) (later in its own list)"));
}

TEST_CASE("plan: validate refuses missing, repeated, misplaced and mixed tasks", "[plan]") {
  // Missing: micro-batch 1 has no backward on stage 1.
  CHECK_THROWS_WITH(validate(hand_made(2, {{F(0, 0), F(0, 1), B(0, 0), B(0, 1)},
                                           {F(1, 0), B(1, 0), F(1, 1)}})),
                    Contains("B(stage 1, micro-batch 1) is missing"));
  CHECK_THROWS_WITH(validate(hand_made(1, {{F(0, 0), I(0, 0)}})),
                    Contains("W(stage 0, micro-batch 0) is missing"));
  CHECK_THROWS_WITH(validate(hand_made(2, {{F(0, 0), B(0, 0)}})),
                    Contains("F(stage 0, micro-batch 1) is missing"));
  // Repeated.
  CHECK_THROWS_WITH(validate(hand_made(1, {{F(0, 0), F(0, 0), B(0, 0)}})),
                    Contains("F(stage 0, micro-batch 0) appears twice") &&
                        Contains("worker 0's task 0 and worker 0's task 1"));
  // On the wrong worker: stage 1 runs on worker 1.
  CHECK_THROWS_WITH(validate(hand_made(1, {{F(0, 0), B(0, 0)}, {F(0, 0), B(1, 0)}})),
                    Contains("F(stage 0, micro-batch 0) is in worker 1's list but stage 0 runs "
                             "on worker 0"));
  // B and its split halves both.
  CHECK_THROWS_WITH(validate(hand_made(1, {{F(0, 0), I(0, 0), W(0, 0), B(0, 0)}})),
                    Contains("B(stage 0, micro-batch 0) and I(stage 0, micro-batch 0) both "
                             "appear"));
  // Out of range.
  CHECK_THROWS_WITH(validate(hand_made(1, {{F(0, 0), B(0, 0), F(0, 1)}})),
                    Contains("micro-batch 1 is out of range for a plan of 1 micro-batches"));
  CHECK_THROWS_WITH(validate(hand_made(1, {{F(3, 0), B(0, 0)}})),
                    Contains("stage 3 is out of range for a plan of 1 stages"));
  // Lists and workers disagree.
  Plan short_of_lists = gpipe_plan(3, 2);
  short_of_lists.lists.pop_back();
  CHECK_THROWS_WITH(validate(short_of_lists), Contains("2 lists for 3 workers"));
  Plan odd_stages = gpipe_plan(2, 2);
  odd_stages.stages = 3;
  CHECK_THROWS_WITH(validate(odd_stages), Contains("3 stages on 2 workers"));
}

TEST_CASE("plan: gpipe and 1f1b take (M + W - 1)(f + b)", "[plan]") {
  const Costs costs{1, 2, 1, 1};
  for (int64_t w = 1; w <= 8; ++w) {
    for (int64_t m = 1; m <= 40; ++m) {
      CAPTURE(w, m);
      const double closed_form = static_cast<double>(m + w - 1) * (costs.f + costs.b);
      CHECK(simulate(gpipe_plan(w, m), costs).makespan == closed_form);
      CHECK(simulate(one_f_one_b_plan(w, m), costs).makespan == closed_form);
    }
  }
  const Plan plan = one_f_one_b_plan(8, 32);
  const Simulation sim = simulate(plan, costs);
  CHECK(sim.work == 8 * 32 * 3);
  CHECK(sim.bubble == Approx(1 - 96.0 / 117));
  REQUIRE(sim.start.size() == 8);
  CHECK(sim.start[0].size() == 64);
  CHECK(sim.start[7][0] == 7);  // the last worker's first forward
}

TEST_CASE("plan: interleaved 1f1b divides the bubble by the stages per worker", "[plan]") {
  // Each of v chunks costs 1/v of a whole stage, so the work per micro-batch
  // stays f + b and the bubble shrinks to (W - 1)(f + b) / v.
  for (int64_t v = 1; v <= 4; ++v) {
    const Costs costs{1.0 / static_cast<double>(v), 2.0 / static_cast<double>(v), 1, 1};
    for (int64_t w = 1; w <= 8; ++w) {
      for (int64_t m = w; m <= 40; m += w) {
        CAPTURE(v, w, m);
        CHECK(simulate(interleaved_1f1b_plan(w, v, m), costs).makespan ==
              Approx(static_cast<double>(m) * 3 +
                     static_cast<double>(w - 1) * 3 / static_cast<double>(v)));
      }
    }
  }
}

TEST_CASE("plan: zb-h1 takes the paper's M(f + i + w) + (W - 1)(f + i - w)", "[plan]") {
  // 1F1B's bubble is (W - 1)(f + b); ZB-H1's is (W - 1)(f + i - w) when
  // M >= W: the drain hops back by I's instead of B's, and the last workers'
  // deferred W's fill it. With M < W there are too few W's to fill it: the
  // last micro-batch's F and I cross the pipeline after M(f + i) on the
  // last worker, and worker 0's W ends the step.
  auto closed_form = [](int64_t w, int64_t m, const Costs& c) {
    const auto workers = static_cast<double>(w);
    const auto micro = static_cast<double>(m);
    return m >= w ? micro * (c.f + c.i + c.w) + (workers - 1) * (c.f + c.i - c.w)
                  : (micro + workers - 1) * (c.f + c.i) + c.w;
  };
  for (const Costs& costs : {Costs{1, 2, 1, 1}, Costs{1, 2, 1.5, 0.5}, Costs{2, 2, 1, 1},
                             Costs{1, 2.5, 1.5, 1}, Costs{1, 1, 0.5, 0.5}}) {
    for (int64_t w = 1; w <= 8; ++w) {
      for (int64_t m = 1; m <= 40; ++m) {
        CAPTURE(costs.f, costs.i, costs.w, w, m);
        const double makespan = simulate(zb_h1_plan(w, m), costs).makespan;
        CHECK(makespan == Approx(closed_form(w, m, costs)));
        // Never slower than 1F1B with B = I + W.
        const Costs whole{costs.f, costs.i + costs.w, costs.i, costs.w};
        CHECK(makespan <= simulate(one_f_one_b_plan(w, m), whole).makespan);
      }
    }
  }
  // Equal costs, as test pictures: 3M + (W - 1) ticks, or 2(M + W) - 1.
  const Costs costs{1, 2, 1, 1};
  CHECK(simulate(zb_h1_plan(4, 8), costs).makespan == 27);
  CHECK(simulate(zb_h1_plan(4, 2), costs).makespan == 11);
  const Plan plan = zb_h1_plan(8, 32);
  const Simulation sim = simulate(plan, costs);
  CHECK(sim.makespan == 103);
  CHECK(efficiency(plan, sim) == Approx(96.0 / 103));
  CHECK(efficiency(plan, sim) >= 0.9);
  const Plan baseline = one_f_one_b_plan(8, 32);
  CHECK(efficiency(plan, sim) > efficiency(baseline, simulate(baseline, costs)) + 0.1);
}

TEST_CASE("plan: micro-batches in flight per worker", "[plan]") {
  for (int64_t w = 1; w <= 8; ++w) {
    for (int64_t m = 1; m <= 20; ++m) {
      CAPTURE(w, m);
      const auto gpipe = simulate(gpipe_plan(w, m)).peak_in_flight;
      const auto one_f_one_b = simulate(one_f_one_b_plan(w, m)).peak_in_flight;
      const auto zb = simulate(zb_h1_plan(w, m)).peak_in_flight;
      REQUIRE(gpipe.size() == static_cast<size_t>(w));
      for (int64_t k = 0; k < w; ++k) {
        const auto at = static_cast<size_t>(k);
        CHECK(gpipe[at] == m);
        CHECK(one_f_one_b[at] == std::min(w - k, m));
        // ZB-H1 keeps 1F1B's peak, that of its worker 0, on every worker.
        CHECK(zb[at] <= std::min(w, m));
      }
      CHECK(*std::max_element(zb.begin(), zb.end()) == std::min(w, m));
    }
  }
  // Where 1F1B's later workers hold fewer, ZB-H1's use the room for W's.
  CHECK(simulate(zb_h1_plan(4, 8)).peak_in_flight == std::vector<int64_t>{4, 4, 4, 4});
  // Interleaved: Megatron's warm-up plus one, counting every chunk.
  const auto interleaved = simulate(interleaved_1f1b_plan(4, 2, 8)).peak_in_flight;
  CHECK(interleaved == std::vector<int64_t>{11, 9, 7, 5});
}

TEST_CASE("plan: make_plan, names and errors", "[plan]") {
  CHECK(make_plan(PlanKind::GPipe, 3, 1, 4).lists == gpipe_plan(3, 4).lists);
  CHECK(make_plan(PlanKind::OneFOneB, 3, 1, 4).lists == one_f_one_b_plan(3, 4).lists);
  CHECK(make_plan(PlanKind::Interleaved1F1B, 3, 2, 4).lists ==
        interleaved_1f1b_plan(3, 2, 4).lists);
  CHECK(make_plan(PlanKind::ZBH1, 3, 1, 4).lists == zb_h1_plan(3, 4).lists);
  CHECK(make_plan(PlanKind::ZBH1, 3, 1, 4).kind == PlanKind::ZBH1);
  CHECK_THROWS_WITH(make_plan(PlanKind::OneFOneB, 2, 2, 4),
                    "virtual_stages is 2 but schedule 1f1b runs one stage per worker; use "
                    "interleaved_1f1b or virtual_stages=1");
  CHECK_THROWS_WITH(gpipe_plan(0, 4), Contains("workers is 0"));
  CHECK_THROWS_WITH(one_f_one_b_plan(2, 0), Contains("microbatches is 0"));
  CHECK_THROWS_WITH(interleaved_1f1b_plan(2, 0, 4), Contains("virtual_stages is 0"));
  CHECK_THROWS_WITH(zb_h1_plan(-1, 4), Contains("workers is -1"));
  CHECK_THROWS_WITH(simulate(gpipe_plan(2, 2), Costs{1, -2, 1, 1}), Contains("cost b is -2"));

  CHECK(to_string(PlanKind::GPipe) == "gpipe");
  CHECK(to_string(PlanKind::OneFOneB) == "1f1b");
  CHECK(to_string(PlanKind::Interleaved1F1B) == "interleaved_1f1b");
  CHECK(to_string(PlanKind::ZBH1) == "zb_h1");
  std::ostringstream out;
  out << F(2, 3) << " " << I(0, 0) << " " << W(1, 12);
  CHECK(out.str() == "F3 I0 W12");
  CHECK(describe(F(2, 3)) == "F(stage 2, micro-batch 3)");
  CHECK(describe(B(0, 1)) == "B(stage 0, micro-batch 1)");
}

TEST_CASE("plan: torch's CSV schedule format, both ways", "[plan]") {
  using gpipe::detail::plan_from_csv;
  using gpipe::detail::plan_to_csv;
  // A literal table: 1F1B on 2 rows, 3 micro-batches, idle cells as torch
  // writes them (None -> empty), spaces and a trailing newline.
  const Plan table = plan_from_csv(
      "0F0,0F1,,0B0,0F2,0B1,,0B2\n"
      ",1F0,1B0,1F1,1B1,1F2, 1B2 \n");
  CHECK(table.kind == PlanKind::Custom);
  CHECK(table.workers == 2);
  CHECK(table.stages == 2);
  CHECK(table.microbatches == 3);
  CHECK(table.lists[0] == std::vector<Task>{F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1),
                                            B(0, 2)});
  CHECK(table.lists[1] == std::vector<Task>{F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2),
                                            B(1, 2)});
  CHECK(plan_to_csv(table) == "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n");
  // Every generated plan survives the round trip (virtual stages, I and W).
  for (const Plan& p : {gpipe_plan(3, 4), one_f_one_b_plan(4, 8), interleaved_1f1b_plan(2, 3, 5),
                        zb_h1_plan(4, 6)}) {
    const Plan back = plan_from_csv(plan_to_csv(p));
    CHECK(back.lists == p.lists);
    CHECK(back.stages == p.stages);
    CHECK(back.microbatches == p.microbatches);
  }
  CHECK(plan_to_csv(zb_h1_plan(2, 2)) == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n");
}

TEST_CASE("plan: a bad CSV schedule is refused, naming the cell or the actions", "[plan]") {
  using gpipe::detail::plan_from_csv;
  CHECK_THROWS_WITH(plan_from_csv(""), Contains("has no rows"));
  CHECK_THROWS_WITH(plan_from_csv("0F0,0X1\n"),
                    Contains("row 0, cell 1 ('0X1') is not an action") &&
                        Contains("<stage><F|I|W|B><micro-batch>"));
  CHECK_THROWS_WITH(plan_from_csv("0F0,F1\n"), Contains("('F1') is not an action"));
  CHECK_THROWS_WITH(plan_from_csv("0F0,0SEND_F0,0B0\n"),
                    Contains("SEND_F is not a compute action") && Contains("compute_only"));
  CHECK_THROWS_WITH(plan_from_csv("0F0,0UNSHARD\n"), Contains("UNSHARD is not a compute action"));
  // Stages 0 and 1 in row 0, 2 and 3 in row 1: a placement of its own (neither a loop
  // nor a V), which the engine does not run.
  const Plan blocks = plan_from_csv("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n");
  CHECK(blocks.placement == std::vector<int64_t>{0, 0, 1, 1});
  CHECK_FALSE(v_placed(blocks));
  CHECK_THROWS_WITH(require_runnable_placement(blocks),
                    Contains("runs stage 1 on row 0, but gpipe runs stage s on row s mod 2, or 4 "
                             "stages in a V (row r: stages r and 3 - r)") &&
                        Contains("move stage 1's actions to row 1"));
  // A stage's actions in two rows, and rows holding different numbers of stages.
  CHECK_THROWS_WITH(plan_from_csv("0F0,1F0,1B0,0B0\n1F1,1B1\n"),
                    Contains("F(stage 1, micro-batch 1) is in row 1, but stage 1 has tasks in "
                             "row 0 too"));
  CHECK_THROWS_WITH(plan_from_csv("0F0,1F0,2F0,2B0,1B0,0B0\n3F0,3B0\n"),
                    Contains("places 3 stages on worker 0; every worker holds the same number"));
  CHECK_THROWS_WITH(plan_from_csv("0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n"),
                    Contains("B(stage 0, micro-batch 1) is missing"));
  // Row 0 waits for B(1, 0) before F(0, 0), which row 1 needs first: a cycle.
  CHECK_THROWS_WITH(plan_from_csv("0B0,0F0\n1F0,1B0\n"), Contains("deadlock"));
}

TEST_CASE("plan: DualPipeV's overlapped F and B cells run as their two actions in order",
          "[plan]") {
  using gpipe::detail::plan_from_csv;
  // torch writes an overlapped pair as one cell, "(<F action>;<B action>)OVERLAP_F_B". gpipe
  // runs its two actions one after the other, in the cell's order. A V on 2 rows: row 0
  // holds stages 0 and 3, row 1 stages 1 and 2.
  const Plan table = plan_from_csv(
      "0F0,0F1,3F0,3B0,3F1,(0F2;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,0B1,0B2\n"
      "1F0,2F0,1F1,2F1,2B0,(1F2;2B1)OVERLAP_F_B,1B0,2F2,2B2,1B1,1B2\n");
  CHECK(table.lists[0] == std::vector<Task>{F(0, 0), F(0, 1), F(3, 0), B(3, 0), F(3, 1),
                                            F(0, 2), B(3, 1), F(3, 2), B(0, 0), B(3, 2),
                                            B(0, 1), B(0, 2)});
  CHECK(table.lists[1] == std::vector<Task>{F(1, 0), F(2, 0), F(1, 1), F(2, 1), B(2, 0),
                                            F(1, 2), B(2, 1), B(1, 0), F(2, 2), B(2, 2),
                                            B(1, 1), B(1, 2)});
  CHECK(v_placed(table));
  // Written back, the pair is two cells.
  CHECK(gpipe::detail::plan_to_csv(table).rfind("0F0,0F1,3F0,3B0,3F1,0F2,3B1,3F2,0B0,", 0) == 0);
  // A malformed pair names the cell and the form.
  CHECK_THROWS_WITH(plan_from_csv("(0F0;0B0\n"),
                    Contains("row 0, cell 0 ('(0F0;0B0')") &&
                        Contains("(<action>;<action>)OVERLAP_F_B"));
  CHECK_THROWS_WITH(plan_from_csv("(0F0)OVERLAP_F_B,0B0\n"),
                    Contains("(<action>;<action>)OVERLAP_F_B"));
  CHECK_THROWS_WITH(plan_from_csv("(0F0;0X0)OVERLAP_F_B\n"),
                    Contains("row 0, cell 0 ('0X0') is not an action"));
}

TEST_CASE("plan: a CSV with B then W for one micro-batch names the older B-for-I spelling",
          "[plan]") {
  // Older torch.distributed.pipelining tables wrote the input half as B (now I) before W.
  CHECK_THROWS_WITH(gpipe::detail::plan_from_csv("0F0,0B0,0W0\n"),
                    Contains("B(stage 0, micro-batch 0) and W(stage 0, micro-batch 0) both "
                             "appear") &&
                        Contains("write that B as I"));
}

TEST_CASE("plan: ZB-V in pictures, its placement and its CSV", "[plan]") {
  // Worker 0 holds stages 0 and 3, worker 1 stages 1 and 2 (the V's turn); ".s" names the
  // stage. Worker 0 admits two micro-batches into stage 0 (min(W, M)) before their W's.
  const Plan plan = zb_v_plan(2, 4);
  CHECK(plan.placement == std::vector<int64_t>{0, 1, 1, 0});
  CHECK(v_placement(3) == std::vector<int64_t>{0, 1, 2, 2, 1, 0});
  CHECK(render(plan) ==
        "worker 0: F0.0 F1.0 .... F0.3 I0.3 F1.3 I1.3 I0.0 W0.3 I1.0 W1.3 W0.0 F2.0 W1.0 F3.0 "
        "F2.3 I2.3 F3.3 I3.3 I2.0 W2.3 I3.0 W3.3 W2.0 W3.0\n"
        "worker 1: .... F0.1 F0.2 F1.1 F1.2 I0.2 I0.1 I1.2 I1.1 W0.2 W0.1 W1.2 W1.1 F2.1 F2.2 "
        "F3.1 F3.2 I2.2 I2.1 I3.2 I3.1 W2.2 W2.1 W3.2 W3.1\n");
  CHECK(plan_to_csv(zb_v_plan(2, 2)) ==
        "0F0,0F1,3F0,3I0,3F1,3I1,0I0,3W0,0I1,3W1,0W0,0W1\n"
        "1F0,2F0,1F1,2F1,2I0,1I0,2I1,1I1,2W0,1W0,2W1,1W1\n");
  // The CSV carries the placement: each stage's row.
  const Plan back = plan_from_csv(plan_to_csv(zb_v_plan(3, 4)));
  CHECK(back.placement == v_placement(3));
  CHECK(back.lists == zb_v_plan(3, 4).lists);
  CHECK(v_placed(back));
  CHECK_NOTHROW(require_runnable_placement(back));  // the engine runs a V
  CHECK_FALSE(v_placed(plan_from_csv(plan_to_csv(zb_h1_plan(3, 4)))));
  CHECK_NOTHROW(require_runnable_placement(plan_from_csv(plan_to_csv(zb_h1_plan(3, 4)))));
  CHECK(plan_from_csv(plan_to_csv(zb_h1_plan(3, 4))).placement.empty());  // the loop
  // A task in a list its stage is not placed on names the placement.
  Plan moved = zb_v_plan(2, 2);
  std::swap(moved.lists[0], moved.lists[1]);
  CHECK_THROWS_WITH(validate(moved), Contains("stage 1 runs on worker 1 (the plan's placement)"));
  CHECK(make_plan(PlanKind::ZBV, 3, 2, 5).lists == zb_v_plan(3, 5).lists);
  CHECK(to_string(PlanKind::ZBV) == "zb_v");
  CHECK_THROWS_WITH(make_plan(PlanKind::ZBV, 3, 1, 5), Contains("pass virtual_stages=2"));
}

TEST_CASE("plan: ZB-V is valid, holds 1F1B's activation memory and beats ZB-H1", "[plan]") {
  for (int64_t w = 1; w <= 8; ++w) {
    for (int64_t m = 1; m <= 40; ++m) {
      CAPTURE(w, m);
      const Plan plan = zb_v_plan(w, m);
      REQUIRE_NOTHROW(validate(plan));
      // Pairs of half a stage each: at most 2 min(W, M), 1F1B's min(W, M) whole stages.
      const auto peak = simulate(plan).peak_in_flight;
      CHECK(*std::max_element(peak.begin(), peak.end()) <= 2 * std::min(w, m));
      // Unequal costs run too (the order is fixed; only the times move).
      CHECK_NOTHROW(simulate(plan, Costs{1, 2, 1.3, 0.7}));
    }
  }
  // Half-size stages against ZB-H1's whole ones, f = i = w: the goal is 0.95 of
  // perfect at W = 8, M = 32 (ZB-H1: 0.932).
  const auto vs_perfect = [](const Plan& plan, const Costs& costs) {
    return 3.0 * static_cast<double>(plan.microbatches) / simulate(plan, costs).makespan;
  };
  const double zb_v = vs_perfect(zb_v_plan(8, 32), Costs{0.5, 1, 0.5, 0.5});
  const double zb_h1 = vs_perfect(zb_h1_plan(8, 32), Costs{1, 2, 1, 1});
  CHECK(zb_v >= 0.95);
  CHECK(zb_v > zb_h1);
  CHECK(zb_v == Approx(0.965).margin(0.001));
}
