// test_transport_c10d.cpp — what each rank of a distributed step receives and sends, and the process-group transport itself between ranks as threads (fake groups, by tag and by order).
#include "../../csrc/transport_c10d.h"

#include "fake_group.h"
#include "models.h"

#include <map>
#include <tuple>

using gpipe::detail::Address;
using gpipe::detail::Flow;
using gpipe::detail::Handoffs;
using gpipe::detail::make_plan;
using gpipe::detail::plan_handoffs;
using gpipe::detail::PlanKind;
using gpipe::detail::SkipRoute;

namespace {

using Key = std::tuple<int64_t, int, int64_t, int64_t>;
Key key(const Address& a) { return {a.stage, static_cast<int>(a.flow), a.microbatch, a.route}; }

// The rank that sends to `at` (transport_c10d.h's rule), for R ranks.
int64_t source(const Address& at, int64_t ranks, const std::vector<SkipRoute>& routes) {
  switch (at.flow) {
    case Flow::Activation:
      return (at.stage - 1) % ranks;
    case Flow::Grad:
      return (at.stage + 1) % ranks;
    case Flow::Skip:
      return routes[static_cast<size_t>(at.route)].from % ranks;
    case Flow::SkipGrad:
      return routes[static_cast<size_t>(at.route)].to % ranks;
  }
  return -1;
}

}  // namespace

TEST_CASE("transport_c10d: every rank's sends are another rank's receives, once each",
          "[transport]") {
  const std::vector<SkipRoute> routes{{0, 3}, {1, 2}};
  for (auto [kind, v] : {std::pair{PlanKind::GPipe, 1}, std::pair{PlanKind::OneFOneB, 1},
                         std::pair{PlanKind::Interleaved1F1B, 2}, std::pair{PlanKind::ZBH1, 1}}) {
    const int64_t ranks = 4;
    const int64_t m = 8;
    const auto plan = make_plan(kind, ranks, v, m);
    std::map<Key, int64_t> sent;      // address -> sending rank
    std::map<Key, int64_t> received;  // address -> receiving rank
    for (int64_t r = 0; r < ranks; ++r) {
      const Handoffs h = plan_handoffs(plan, r, routes);
      for (const auto& a : h.sends) CHECK(sent.emplace(key(a), r).second);
      for (const auto& a : h.receives) {
        CHECK(a.stage % ranks == r);  // at one of the rank's own stages
        CHECK(received.emplace(key(a), r).second);
      }
    }
    REQUIRE(sent.size() == received.size());
    for (const auto& [k, r] : received) {
      REQUIRE(sent.count(k) == 1);
      const auto& [stage, flow, microbatch, route] = k;
      CHECK(sent.at(k) == source({stage, static_cast<Flow>(flow), microbatch, route}, ranks,
                                 routes));
      CHECK(r == stage % ranks);
    }
    // Forward hand-offs between consecutive stages, grads back; two skips
    // and their grads: per micro-batch 2 (K - 1) + 4.
    const int64_t stages = ranks * v;
    CHECK(static_cast<int64_t>(received.size()) == m * (2 * (stages - 1) + 4));
  }
}

TEST_CASE("transport_c10d: eval's forwards-only plan hands activations only", "[transport]") {
  auto plan = make_plan(PlanKind::OneFOneB, 2, 1, 3);
  for (auto& list : plan.lists) {
    std::erase_if(list, [](const gpipe::detail::Task& t) { return t.op != gpipe::detail::Op::F; });
  }
  const Handoffs first = plan_handoffs(plan, 0);
  const Handoffs last = plan_handoffs(plan, 1);
  CHECK(first.receives.empty());
  REQUIRE(first.sends.size() == 3);
  REQUIRE(last.receives.size() == 3);
  CHECK(last.sends.empty());
  for (int64_t i = 0; i < 3; ++i) {
    CHECK(first.sends[static_cast<size_t>(i)].flow == Flow::Activation);
    CHECK(last.receives[static_cast<size_t>(i)].microbatch == i);
  }
}

namespace {

using gpipe::detail::Batch;
using gpipe::detail::Payload;
using gpipe::detail::ProcessGroupTransport;

// Two ranks, one stage each, two micro-batches: rank 0 hands activations
// to rank 1, rank 1 hands grads back, for three steps whose shapes change
// (rows) on step 2 and stay on step 3 (the early receives of last step's
// shapes, then filler and the changed tensors, then early receives again).
// Returns each rank's error ("" where it ran through); what arrived is
// checked against what was sent into `mismatches`.
std::vector<std::string> round_trips(gpipe_test::FakeMatching matching, bool reverse_group,
                                     std::vector<std::string>& mismatches) {
  const auto groups = gpipe_test::make_fake_groups(2, matching, std::chrono::seconds(10));
  const auto reverse = reverse_group ? gpipe_test::make_fake_groups(2, matching,
                                                                    std::chrono::seconds(10))
                                     : groups;
  const auto plan = make_plan(PlanKind::OneFOneB, 2, 1, 2);
  std::vector<std::vector<std::string>> wrong(2);
  auto value = [](int64_t step, int64_t i, Flow flow, int64_t rows) {
    return torch::full({rows, 3}, step * 100.0 + i * 10.0 + static_cast<double>(flow),
                       torch::kFloat64);
  };
  auto errors = gpipe_test::run_ranks(2, [&](int rank) {
    ProcessGroupTransport transport(groups[static_cast<size_t>(rank)],
                                    reverse[static_cast<size_t>(rank)], /*stages=*/2);
    for (int64_t step = 1; step <= 3; ++step) {
      const int64_t rows = step == 1 ? 2 : 4;
      transport.begin(2, plan_handoffs(plan, rank));
      for (int64_t i = 0; i < 2; ++i) {
        if (rank == 0) {
          transport.send({1, Flow::Activation, i}, Payload{Batch(value(step, i, Flow::Activation, rows)), {}});
        } else {
          auto got = transport.receive({1, Flow::Activation, i});
          if (!got || !got->batch[0].equal(value(step, i, Flow::Activation, rows))) {
            wrong[1].push_back("activation " + std::to_string(step) + "/" + std::to_string(i));
          }
        }
      }
      for (int64_t i = 0; i < 2; ++i) {
        if (rank == 1) {
          transport.send({0, Flow::Grad, i}, Payload{Batch(value(step, i, Flow::Grad, rows)), {}});
        } else {
          auto got = transport.receive({0, Flow::Grad, i});
          if (!got || !got->batch[0].equal(value(step, i, Flow::Grad, rows))) {
            wrong[0].push_back("grad " + std::to_string(step) + "/" + std::to_string(i));
          }
        }
      }
      transport.finish();
    }
  });
  for (auto& w : wrong) mismatches.insert(mismatches.end(), w.begin(), w.end());
  return errors;
}

// Rank 1 fails before sending its grads: rank 0, waiting for them, fails
// with an error naming rank 1 and its message, well before the timeout.
std::vector<std::string> failure_header(gpipe_test::FakeMatching matching, bool reverse_group) {
  const auto groups = gpipe_test::make_fake_groups(2, matching, std::chrono::seconds(10));
  const auto reverse = reverse_group ? gpipe_test::make_fake_groups(2, matching,
                                                                    std::chrono::seconds(10))
                                     : groups;
  const auto plan = make_plan(PlanKind::GPipe, 2, 1, 1);
  return gpipe_test::run_ranks(2, [&](int rank) {
    ProcessGroupTransport transport(groups[static_cast<size_t>(rank)],
                                    reverse[static_cast<size_t>(rank)], /*stages=*/2);
    transport.begin(1, plan_handoffs(plan, rank));
    if (rank == 0) {
      transport.send({1, Flow::Activation, 0}, Payload{Batch(torch::ones({2, 2})), {}});
      transport.receive({0, Flow::Grad, 0});
      transport.finish();
    } else {
      transport.receive({1, Flow::Activation, 0});
      transport.fail("stage 1 failed on purpose");
      throw std::runtime_error("stage 1 failed on purpose");
    }
  });
}

}  // namespace

TEST_CASE("transport_c10d: by tag (Gloo-like), hand-offs both ways arrive intact as shapes change",
          "[transport]") {
  std::vector<std::string> mismatches;
  const auto errors = round_trips(gpipe_test::FakeMatching::ByTag, false, mismatches);
  CHECK(errors == std::vector<std::string>(2));
  CHECK(mismatches.empty());
}

TEST_CASE("transport_c10d: by tag (Gloo-like), a failure header names the failing rank",
          "[transport]") {
  const auto start = gpipe_test::Clock::now();
  const auto errors = failure_header(gpipe_test::FakeMatching::ByTag, false);
  CHECK(gpipe_test::Clock::now() - start < std::chrono::seconds(5));
  CHECK_THAT(errors[0], Catch::Contains("rank 1 failed") &&
                            Catch::Contains("stage 1 failed on purpose"));
  CHECK(errors[1] == "stage 1 failed on purpose");
}

// NCCL-like matching: needs the transport's ordered hand-off mode (until
// then the transport refuses a non-Gloo group of several ranks).
TEST_CASE("transport_c10d: by order (NCCL-like, reverse group), hand-offs both ways arrive "
          "intact as shapes change",
          "[transport][ordered]") {
  std::vector<std::string> mismatches;
  const auto errors = round_trips(gpipe_test::FakeMatching::ByOrder, true, mismatches);
  CHECK(errors == std::vector<std::string>(2));
  CHECK(mismatches.empty());
}

TEST_CASE("transport_c10d: by order (NCCL-like, reverse group), a failure header names the "
          "failing rank",
          "[transport][ordered]") {
  const auto start = gpipe_test::Clock::now();
  const auto errors = failure_header(gpipe_test::FakeMatching::ByOrder, true);
  CHECK(gpipe_test::Clock::now() - start < std::chrono::seconds(5));
  CHECK_THAT(errors[0], Catch::Contains("rank 1 failed") &&
                            Catch::Contains("stage 1 failed on purpose"));
  CHECK(errors[1] == "stage 1 failed on purpose");
}
