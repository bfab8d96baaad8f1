// test_fake_group.cpp — the fake process groups the distributed tests run on: matching by tag and by order, NCCL's deadlock as an error, abort, allreduce.
#include "fake_group.h"

#include "models.h"

using gpipe_test::FakeMatching;
using gpipe_test::make_fake_groups;
using gpipe_test::run_ranks;

namespace {

using namespace std::chrono_literals;

torch::Tensor full(std::vector<int64_t> shape, double value) {
  return torch::full(shape, value, torch::kFloat64);
}

// Waits for `work`, turning a failure into its message ("" when done).
std::string outcome(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    return work->wait() ? "" : "aborted";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

TEST_CASE("fake_group: by tag, a recv takes the oldest send of its tag, sends complete at once",
          "[fake]") {
  auto groups = make_fake_groups(2, FakeMatching::ByTag);
  CHECK(groups[0]->getBackendName() == "gloo");
  CHECK(groups[1]->getRank() == 1);
  CHECK(groups[1]->getSize() == 2);
  std::vector<torch::Tensor> a{full({2}, 1.0)}, b{full({2}, 2.0)}, c{full({2}, 3.0)};
  auto sa = groups[0]->send(a, 1, /*tag=*/7);
  auto sb = groups[0]->send(b, 1, /*tag=*/3);
  auto sc = groups[0]->send(c, 1, /*tag=*/7);
  CHECK(sa->isCompleted());  // buffered, before any recv
  a[0].fill_(-1.0);          // the buffered copy keeps what was sent
  std::vector<torch::Tensor> r1{torch::empty({2}, torch::kFloat64)};
  std::vector<torch::Tensor> r2{torch::empty({2}, torch::kFloat64)};
  std::vector<torch::Tensor> r3{torch::empty({2}, torch::kFloat64)};
  CHECK(groups[1]->recv(r1, 0, 3)->wait());
  CHECK(groups[1]->recv(r2, 0, 7)->wait());
  CHECK(groups[1]->recv(r3, 0, 7)->wait());
  CHECK(r1[0].equal(full({2}, 2.0)));
  CHECK(r2[0].equal(full({2}, 1.0)));
  CHECK(r3[0].equal(full({2}, 3.0)));
  // A recv posted first is matched by the later send.
  std::vector<torch::Tensor> r4{torch::empty({1}, torch::kFloat64)};
  auto early = groups[0]->recv(r4, 1, 5);
  CHECK_FALSE(early->isCompleted());
  std::vector<torch::Tensor> d{full({1}, 4.0)};
  groups[1]->send(d, 0, 5);
  CHECK(early->wait());
  CHECK(r4[0].item<double>() == 4.0);
}

TEST_CASE("fake_group: by order, tags are ignored and a send waits for the peer's recv",
          "[fake]") {
  auto groups = make_fake_groups(2, FakeMatching::ByOrder);
  CHECK(groups[0]->getBackendName() == "fake_nccl");
  std::vector<torch::Tensor> a{full({2}, 1.0)}, b{full({3}, 2.0)};
  auto sa = groups[0]->send(a, 1, /*tag=*/5);
  auto sb = groups[0]->send(b, 1, /*tag=*/9);
  CHECK_FALSE(sa->isCompleted());  // a rendezvous: no recv yet
  std::vector<torch::Tensor> r1{torch::empty({2}, torch::kFloat64)};
  std::vector<torch::Tensor> r2{torch::empty({3}, torch::kFloat64)};
  // The tags are the other way round: order decides.
  auto w1 = groups[1]->recv(r1, 0, /*tag=*/9);
  auto w2 = groups[1]->recv(r2, 0, /*tag=*/5);
  CHECK(sa->wait());
  CHECK(sb->wait());
  CHECK(w1->wait());
  CHECK(w2->wait());
  CHECK(r1[0].equal(full({2}, 1.0)));
  CHECK(r2[0].equal(full({3}, 2.0)));
}

TEST_CASE("fake_group: by order, a size mismatch fails both ends naming both shapes", "[fake]") {
  auto groups = make_fake_groups(2, FakeMatching::ByOrder);
  std::vector<torch::Tensor> a{full({2, 3}, 1.0)};
  std::vector<torch::Tensor> r{torch::empty({3, 2}, torch::kFloat64)};
  auto s = groups[0]->send(a, 1, 0);
  auto w = groups[1]->recv(r, 0, 0);
  for (const auto& work : {s, w}) {
    const std::string what = outcome(work);
    CHECK_THAT(what, Catch::Contains("[2, 3]") && Catch::Contains("[3, 2]") &&
                         Catch::Contains("rank 0") && Catch::Contains("rank 1"));
  }
}

TEST_CASE("fake_group: [recv, send] against [recv, send] deadlocks by order (an error), not by tag",
          "[fake]") {
  for (auto matching : {FakeMatching::ByOrder, FakeMatching::ByTag}) {
    auto groups = make_fake_groups(2, matching, /*timeout=*/300ms);
    std::vector<std::string> received(2);
    const auto start = gpipe_test::Clock::now();
    const auto errors = run_ranks(2, [&](int rank) {
      const int peer = 1 - rank;
      std::vector<torch::Tensor> in{torch::empty({2}, torch::kFloat64)};
      std::vector<torch::Tensor> out{full({2}, rank + 1.0)};
      auto r = groups[static_cast<size_t>(rank)]->recv(in, peer, /*tag=*/peer);
      auto s = groups[static_cast<size_t>(rank)]->send(out, peer, /*tag=*/rank);
      r->wait();
      s->wait();
      received[static_cast<size_t>(rank)] = std::to_string(in[0][0].item<double>());
    });
    if (matching == FakeMatching::ByTag) {
      CHECK(errors == std::vector<std::string>{"", ""});
      CHECK(received == std::vector<std::string>{std::to_string(2.0), std::to_string(1.0)});
    } else {
      for (int rank = 0; rank < 2; ++rank) {
        INFO(errors[static_cast<size_t>(rank)]);
        CHECK_THAT(errors[static_cast<size_t>(rank)],
                   Catch::Contains("rank " + std::to_string(rank) + "'s recv from rank " +
                                   std::to_string(1 - rank)) &&
                       Catch::Contains("did not complete within 300 ms") &&
                       Catch::Contains("[recv [2] Double, send [2] Double]"));
      }
      CHECK(gpipe_test::Clock::now() - start < 10s);
    }
  }
}

TEST_CASE("fake_group: abort wakes a waiting recv, which returns false", "[fake]") {
  for (auto matching : {FakeMatching::ByTag, FakeMatching::ByOrder}) {
    auto groups = make_fake_groups(2, matching, /*timeout=*/20s);
    std::vector<torch::Tensor> in{torch::empty({2}, torch::kFloat64)};
    auto r = groups[0]->recv(in, 1, 0);
    const auto start = gpipe_test::Clock::now();
    std::thread aborter([&] {
      std::this_thread::sleep_for(50ms);
      r->abort();
    });
    const std::string what = outcome(r);
    aborter.join();
    CHECK(what == "aborted");
    CHECK(gpipe_test::Clock::now() - start < 10s);
    // The aborted recv left the queue: the next send meets the next recv.
    std::vector<torch::Tensor> out{full({2}, 5.0)};
    auto s = groups[1]->send(out, 0, 0);
    auto r2 = groups[0]->recv(in, 1, 0);
    CHECK(outcome(r2).empty());
    CHECK(outcome(s).empty());
    CHECK(in[0].equal(full({2}, 5.0)));
  }
}

TEST_CASE("fake_group: allreduce sums over the ranks, barrier waits for all", "[fake]") {
  auto groups = make_fake_groups(3, FakeMatching::ByOrder);
  std::vector<torch::Tensor> results(3);
  const auto errors = run_ranks(3, [&](int rank) {
    auto& group = groups[static_cast<size_t>(rank)];
    std::vector<torch::Tensor> t{full({2, 2}, rank + 1.0)};
    group->allreduce(t)->wait();
    group->barrier()->wait();
    results[static_cast<size_t>(rank)] = t[0];
  });
  CHECK(errors == std::vector<std::string>(3));
  for (const auto& t : results) CHECK(t.equal(full({2, 2}, 6.0)));
}
