// test_transport_c10d.cpp — what each rank of a distributed step receives and sends (the process-group transport itself runs in tests/python/test_distributed.py: a group needs processes).
#include "../../csrc/transport_c10d.h"

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
