// test_transport_c10d.cpp — what each rank of a distributed step receives and sends, and the process-group transport itself between ranks as threads (fake groups, by tag and by order).
#include "../../csrc/transport_c10d.h"

#include "fake_group.h"
#include "models.h"

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <string>
#include <thread>
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

// Rows per step of round_trips: small batches (48 and 96 bytes: inside the
// header under the tagged mode) and large ones (7200 bytes), shapes that
// change and stay, crossing the inline threshold each way: the early
// receives of last step's shapes, then filler and the changed tensors,
// then early receives again; inline after inline, after large, and large
// after inline.
const std::vector<int64_t> kRoundTripRows{2, 4, 4, 300, 300, 2, 300, 2, 2};

// Two ranks, one stage each, two micro-batches: rank 0 hands activations
// to rank 1, rank 1 hands grads back, for a step per kRoundTripRows entry.
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
    for (int64_t step = 1; step <= static_cast<int64_t>(kRoundTripRows.size()); ++step) {
      const int64_t rows = kRoundTripRows[static_cast<size_t>(step - 1)];
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

// ---- A send's tensors live until its send is done, not until finish ----

namespace {

using gpipe_test::Clock;
using gpipe_test::FakeMatching;

// Whether `t`'s memory is referenced by anything but `t` itself (a send
// holds an alias of the same storage), waiting up to `patience` for it to
// be let go (a reaper thread lets go of Gloo's sends on its own time).
bool released(const at::Tensor& t, std::chrono::milliseconds patience) {
  const auto until = Clock::now() + patience;
  while (t.storage().use_count() > 1) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Handoffs of rank 0 sending activations of micro-batches `microbatches` to
// stage 1 (rank 1), and of rank 1 receiving them.
Handoffs sends_to_1(std::vector<int64_t> microbatches) {
  Handoffs h;
  for (int64_t i : microbatches) h.sends.push_back({1, Flow::Activation, i});
  return h;
}
Handoffs receives_from_0(std::vector<int64_t> microbatches) {
  Handoffs h;
  for (int64_t i : microbatches) h.receives.push_back({1, Flow::Activation, i});
  return h;
}

struct Released {
  bool first_before_finish = false;  // A, once rank 1 took it and B was sent
  bool second_after_finish = false;  // B
  bool finish_waited = false;        // finish returned only after rank 1 took B
  std::vector<std::string> errors;
  std::vector<std::string> mismatches;
};

// Rank 0 sends A, rank 1 takes it; rank 0 sends B and looks whether A's
// memory was let go; rank 1 takes B a while after rank 0 entered finish().
Released release_after_send(FakeMatching matching, bool reverse_group) {
  const auto groups = gpipe_test::make_fake_groups(2, matching, std::chrono::seconds(10));
  const auto reverse =
      reverse_group ? gpipe_test::make_fake_groups(2, matching, std::chrono::seconds(10)) : groups;
  Released out;
  std::promise<void> took_a;
  std::promise<void> finishing;
  Clock::time_point finished;
  Clock::time_point taking_b;
  const at::Tensor a = torch::full({256, 64}, 1.0, torch::kFloat64);
  const at::Tensor b = torch::full({256, 64}, 2.0, torch::kFloat64);
  out.errors = gpipe_test::run_ranks(2, [&](int rank) {
    ProcessGroupTransport transport(groups[static_cast<size_t>(rank)],
                                    reverse[static_cast<size_t>(rank)], /*stages=*/2);
    if (rank == 0) {
      transport.begin(2, sends_to_1({0, 1}));
      transport.send({1, Flow::Activation, 0}, Payload{Batch(a), {}});
      took_a.get_future().wait();
      transport.send({1, Flow::Activation, 1}, Payload{Batch(b), {}});
      out.first_before_finish = released(a, std::chrono::seconds(2));
      finishing.set_value();
      transport.finish();
      finished = Clock::now();
      out.second_after_finish = released(b, std::chrono::milliseconds(0));
    } else {
      transport.begin(2, receives_from_0({0, 1}));
      auto got_a = transport.receive({1, Flow::Activation, 0});
      took_a.set_value();
      finishing.get_future().wait();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      taking_b = Clock::now();
      auto got_b = transport.receive({1, Flow::Activation, 1});
      transport.finish();
      if (!got_a || !got_a->batch[0].equal(a)) out.mismatches.push_back("A");
      if (!got_b || !got_b->batch[0].equal(b)) out.mismatches.push_back("B");
    }
  });
  out.finish_waited = finished >= taking_b;
  return out;
}

// Rank 0 sends A, whose send fails (rank 1 posts a receive of another
// shape for it), then B, which nobody takes: finish() reports A's failure
// (not a timeout waiting for B), naming rank 0. Returns rank 0's error.
std::string failed_send(FakeMatching matching, const std::string& backend, bool reverse_group) {
  const auto groups =
      gpipe_test::make_fake_groups(2, matching, std::chrono::seconds(3), backend);
  const auto reverse = reverse_group
                           ? gpipe_test::make_fake_groups(2, matching, std::chrono::seconds(3),
                                                          backend)
                           : groups;
  std::promise<void> wrong_posted;
  std::promise<void> done;
  const auto errors = gpipe_test::run_ranks(2, [&](int rank) {
    ProcessGroupTransport transport(groups[static_cast<size_t>(rank)],
                                    reverse[static_cast<size_t>(rank)], /*stages=*/2);
    if (rank == 0) {
      transport.begin(2, sends_to_1({0, 1}));
      transport.send({1, Flow::Activation, 0}, Payload{Batch(torch::ones({2, 3})), {}});
      wrong_posted.get_future().wait();
      // A failed by now (the fake completes both ends when they meet); this
      // send is where completed sends are dropped: A must stay.
      transport.send({1, Flow::Activation, 1}, Payload{Batch(torch::ones({2, 3})), {}});
      try {
        transport.finish();
      } catch (...) {
        done.set_value();
        transport.fail("rank 0 stops");
        throw;
      }
      done.set_value();
    } else {
      // The transport posts the first message's header receive; the next
      // receive on this pair, posted by hand with a shape nobody sends,
      // meets A's tensor.
      transport.begin(2, receives_from_0({0}));
      std::vector<at::Tensor> wrong{torch::empty({1}, torch::kFloat32)};
      auto work = groups[1]->recv(wrong, 0, 0);
      wrong_posted.set_value();
      done.get_future().wait();
      transport.fail("rank 1 stops");
    }
  });
  CHECK(errors[1].empty());
  return errors[0];
}

}  // namespace

TEST_CASE("transport_c10d: by tag (Gloo-like), a sent tensor is let go once its send is done, "
          "before finish",
          "[transport]") {
  const auto r = release_after_send(FakeMatching::ByTag, false);
  CHECK(r.errors == std::vector<std::string>(2));
  CHECK(r.mismatches.empty());
  CHECK(r.first_before_finish);
  CHECK(r.second_after_finish);
}

TEST_CASE("transport_c10d: by order (NCCL-like), a sent tensor is let go once its send is done, "
          "a send in flight is waited for",
          "[transport][ordered]") {
  const auto r = release_after_send(FakeMatching::ByOrder, true);
  CHECK(r.errors == std::vector<std::string>(2));
  CHECK(r.mismatches.empty());
  CHECK(r.first_before_finish);
  CHECK(r.second_after_finish);
  // B was still in flight when rank 0 entered finish: it was kept, and waited for.
  CHECK(r.finish_waited);
}

TEST_CASE("transport_c10d: a failed send is kept and reported by finish, naming the rank",
          "[transport]") {
  // Gloo-like (its sends wait for the receiver, as Gloo's do: matched by
  // order here), through the reaper thread; NCCL-like, polled.
  const auto start = Clock::now();
  const auto gloo = failed_send(FakeMatching::ByOrder, "gloo", false);
  CHECK_THAT(gloo, Catch::Contains("rank 0 could not hand its outputs on") &&
                       Catch::Contains("expects [1] Float"));
  const auto nccl = failed_send(FakeMatching::ByOrder, "fake_nccl", true);
  CHECK_THAT(nccl, Catch::Contains("rank 0 could not hand its outputs on") &&
                       Catch::Contains("expects [1] Float"));
  // Reported when it failed, not after the fake's 3 s timeout on B.
  CHECK(Clock::now() - start < std::chrono::seconds(3));
}

// Sends leave the worker (the sender thread delivers them): one whose
// delivery fails stops the step at once. Rank 0 sends micro-batch 0's
// activations (a meta tensor: Gloo reads host memory, and copying a meta
// tensor out throws) and waits for their grads, which rank 1 makes only from
// them. Rank 0's wait ends without waiting out the group's timeout, its
// finish() names the failed send, and its fail() stops rank 1 naming rank 0;
// the same with GPIPE_ASYNC_SENDS=0 (the send throws on the worker).
TEST_CASE("transport_c10d: a send that fails on the sender stops the step at once, both ranks "
          "name rank 0",
          "[transport]") {
  for (const bool async : {true, false}) {
    INFO((async ? "sends on the sender thread" : "GPIPE_ASYNC_SENDS=0"));
    gpipe_test::ScopedEnv sends("GPIPE_ASYNC_SENDS", async ? "1" : "0");
    const auto groups = gpipe_test::make_fake_groups(2, FakeMatching::ByTag,
                                                     std::chrono::seconds(5));
    const auto start = Clock::now();
    bool receive_ended = false;
    const auto errors = gpipe_test::run_ranks(2, [&](int rank) {
      ProcessGroupTransport transport(groups[static_cast<size_t>(rank)], nullptr, /*stages=*/2);
      Handoffs h;
      if (rank == 0) {
        h.sends.push_back({1, Flow::Activation, 0});
        h.receives.push_back({0, Flow::Grad, 0});
        transport.begin(1, h);
        try {
          transport.send({1, Flow::Activation, 0},
                         Payload{Batch(torch::empty({2, 3}, torch::device(torch::kMeta))), {}});
          receive_ended = !transport.receive({0, Flow::Grad, 0}).has_value();
          transport.finish();
        } catch (const std::exception& e) {
          transport.fail(e.what());
          throw;
        }
      } else {
        h.receives.push_back({1, Flow::Activation, 0});
        h.sends.push_back({0, Flow::Grad, 0});
        transport.begin(1, h);
        auto x = transport.receive({1, Flow::Activation, 0});
        TORCH_CHECK(!x, "rank 1 got activations that were never sent");
      }
    });
    CHECK(Clock::now() - start < std::chrono::seconds(5));
    CHECK_THAT(errors[0], Catch::Contains("meta"));
    if (async) {
      CHECK(receive_ended);
      CHECK_THAT(errors[0], Catch::Contains("rank 0 could not hand its outputs on"));
    }
    CHECK_THAT(errors[1], Catch::Contains("rank 0 failed"));
  }
  // Another value is refused by name, before any thread of the transport starts.
  gpipe_test::ScopedEnv sends("GPIPE_ASYNC_SENDS", "2");
  const auto groups = gpipe_test::make_fake_groups(2, FakeMatching::ByTag);
  CHECK_THROWS_WITH(ProcessGroupTransport(groups[0], nullptr, 2),
                    Catch::Contains("GPIPE_ASYNC_SENDS is '2'; set it to 1"));
}

// ---- NCCL's works: abort tears the communicator down, wait does not block ----
//
// The fake's `like_nccl` works (fake_group.h): an abort fails every op of
// the world, and wait() returns at once. The transport must then never
// abort (a failure still reaches every rank by its failure headers) and
// must learn that an op is done from isCompleted(), within step_timeout.

TEST_CASE("transport_c10d: NCCL-like works: a cancel aborts nothing, the cancelled receive just "
          "ends, and the failure reaches the other rank by name",
          "[transport][ordered]") {
  const auto groups = gpipe_test::make_fake_groups(2, FakeMatching::ByOrder,
                                                   std::chrono::seconds(5), "", true);
  const auto reverse = gpipe_test::make_fake_groups(2, FakeMatching::ByOrder,
                                                    std::chrono::seconds(5), "", true);
  const auto start = Clock::now();
  std::string cancelled_receive;
  const auto errors = gpipe_test::run_ranks(2, [&](int rank) {
    ProcessGroupTransport transport(groups[static_cast<size_t>(rank)],
                                    reverse[static_cast<size_t>(rank)], /*stages=*/2);
    transport.set_step_timeout(std::chrono::seconds(4));
    Handoffs h;
    if (rank == 0) {
      // Sends micro-batch 0, then waits for its grads, which never come.
      h.sends = {{1, Flow::Activation, 0}, {1, Flow::Activation, 1}};
      h.receives = {{0, Flow::Grad, 0}};
      transport.begin(2, h);
      transport.send({1, Flow::Activation, 0}, Payload{Batch(torch::ones({2, 2})), {}});
      transport.receive({0, Flow::Grad, 0});
      transport.finish();
      return;
    }
    h.receives = {{1, Flow::Activation, 0}, {1, Flow::Activation, 1}};
    h.sends = {{0, Flow::Grad, 0}};
    transport.begin(2, h);
    TORCH_CHECK(transport.receive({1, Flow::Activation, 0}), "rank 1 got no micro-batch 0");
    // Another worker of rank 1 fails while this one waits for micro-batch 1.
    auto waiting = std::async(std::launch::async, [&] {
      try {
        return transport.receive({1, Flow::Activation, 1}).has_value() ? std::string("received")
                                                                       : std::string("cancelled");
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    transport.cancel();
    cancelled_receive = waiting.get();
    transport.fail("stage 1 failed on purpose");
    throw std::runtime_error("stage 1 failed on purpose");
  });
  CHECK(cancelled_receive == "cancelled");
  CHECK_THAT(errors[0], Catch::Contains("rank 1 failed") &&
                            Catch::Contains("stage 1 failed on purpose"));
  CHECK(errors[1] == "stage 1 failed on purpose");
  CHECK(Clock::now() - start < std::chrono::seconds(3));
}

TEST_CASE("transport_c10d: NCCL-like works: finish waits until the peer took the last send, and "
          "fails naming the step_timeout when it never does",
          "[transport][ordered]") {
  for (const bool taken : {true, false}) {
    INFO((taken ? "rank 1 takes it after 300 ms" : "rank 1 never takes it"));
    const auto groups = gpipe_test::make_fake_groups(2, FakeMatching::ByOrder,
                                                     std::chrono::seconds(5), "", true);
    const auto reverse = gpipe_test::make_fake_groups(2, FakeMatching::ByOrder,
                                                      std::chrono::seconds(5), "", true);
    std::atomic<bool> took{false};
    bool finish_after_take = false;
    std::chrono::milliseconds finish_took{0};
    const auto errors = gpipe_test::run_ranks(2, [&](int rank) {
      ProcessGroupTransport transport(groups[static_cast<size_t>(rank)],
                                      reverse[static_cast<size_t>(rank)], /*stages=*/2);
      transport.set_step_timeout(std::chrono::milliseconds(800));
      if (rank == 0) {
        transport.begin(1, sends_to_1({0}));
        transport.send({1, Flow::Activation, 0}, Payload{Batch(torch::ones({2, 2})), {}});
        const auto entered = Clock::now();
        try {
          transport.finish();
        } catch (...) {
          finish_took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() -
                                                                              entered);
          transport.fail("finish failed");
          throw;
        }
        finish_took =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - entered);
        finish_after_take = took.load();
        return;
      }
      transport.begin(1, taken ? receives_from_0({0}) : Handoffs{});
      if (!taken) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      took = true;
      TORCH_CHECK(transport.receive({1, Flow::Activation, 0}), "rank 1 got nothing");
      transport.finish();
    });
    if (taken) {
      CHECK(errors == std::vector<std::string>(2));
      CHECK(finish_after_take);
    } else {
      CHECK_THAT(errors[0], Catch::Contains("rank 0 waited 0.8 s (the pipe's step_timeout) for "
                                            "the ranks it sent to"));
      CHECK(finish_took < std::chrono::milliseconds(1400));
      CHECK(errors[1].empty());
    }
  }
}

TEST_CASE("transport_c10d: by tag (Gloo-like), a small hand-off is one message (its values "
          "inside the header), a large one a header and its tensors, and batches crossing the "
          "threshold arrive intact",
          "[transport]") {
  const auto groups = gpipe_test::make_fake_groups(2, FakeMatching::ByTag);
  // Per step: the rows of the float64 value (3 columns) of 3 hand-offs of
  // (that, an undefined value, 5 int32s), and the messages rank 0 sends.
  const std::vector<std::pair<int64_t, int64_t>> steps{
      {2, 3},    // 68 bytes: inline, 1 message each
      {4, 3},    // inline again, other shapes
      {300, 9},  // large after inline: nothing expected early; the header and 2 tensors
      {300, 9},  // large again: the header and the 2 tensors posted early
      {2, 9},    // inline after large: the header and filler for the 2 early receives
      {2, 3},    // inline
      {0, 3}};   // no rows: inline too
  std::vector<int64_t> sent(steps.size(), 0);
  std::vector<std::string> wrong;
  const auto errors = gpipe_test::run_ranks(2, [&](int rank) {
    ProcessGroupTransport transport(groups[static_cast<size_t>(rank)], nullptr, /*stages=*/2);
    for (size_t s = 0; s < steps.size(); ++s) {
      const int64_t before = gpipe_test::sends_posted(groups[0]);
      transport.begin(3, rank == 0 ? sends_to_1({0, 1, 2}) : receives_from_0({0, 1, 2}));
      for (int64_t i = 0; i < 3; ++i) {
        Batch batch({torch::full({steps[s].first, 3}, static_cast<double>(s) * 10.0 + i,
                                 torch::kFloat64),
                     torch::Tensor(), torch::arange(5, torch::kInt32) + i},
                    /*is_atomic=*/false);
        batch[0].requires_grad_(i == 1);
        if (rank == 0) {
          transport.send({1, Flow::Activation, i}, Payload{batch, {}});
          continue;
        }
        auto got = transport.receive({1, Flow::Activation, i});
        if (!got || got->batch.size() != 3 || got->batch.atomic ||
            !got->batch[0].equal(batch[0]) || got->batch[1].defined() ||
            !got->batch[2].equal(batch[2]) || got->batch[0].requires_grad() != (i == 1)) {
          wrong.push_back("step " + std::to_string(s) + ", micro-batch " + std::to_string(i));
        }
      }
      transport.finish();
      if (rank == 0) sent[s] = gpipe_test::sends_posted(groups[0]) - before;
    }
  });
  CHECK(errors == std::vector<std::string>(2));
  CHECK(wrong.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    INFO("step " << s << ", " << steps[s].first << " rows");
    CHECK(sent[s] == steps[s].second);
  }
}
