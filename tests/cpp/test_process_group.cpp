// test_process_group.cpp — gpipe::distributed::init_process_group: real Gloo groups (ranks as threads on one store), settings from the environment, and the refusals.
#include "models.h"

#include <gpipe/process_group.h>

#include <catch2/catch.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <future>
#include <string>
#include <vector>

namespace {

using gpipe::distributed::init_process_group;
using gpipe::distributed::ProcessGroupOptions;
using gpipe_test::ScopedEnv;

std::string error_of(const ProcessGroupOptions& options) {
  try {
    init_process_group(options);
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "(no error)";
}

ProcessGroupOptions gloo(int64_t rank, int64_t size, c10::intrusive_ptr<c10d::Store> store) {
  return ProcessGroupOptions().backend("gloo").rank(rank).world_size(size).store(std::move(store));
}

}  // namespace

TEST_CASE("process_group: two Gloo ranks as threads all_reduce and hand off", "[process_group]") {
  if (!gpipe::distributed::has_backend("gloo")) {
    CHECK_THAT(error_of(gloo(0, 1, c10::make_intrusive<c10d::HashStore>())),
               Catch::Contains("libgloo-dev") && Catch::Contains("Python"));
    WARN("this gpipe was built without Gloo: only its refusal was checked");
    return;
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto rank = [&](int r) {
    // Ranks as threads of one process name their group: by default each
    // call of a process is a group of its own (the n-th of every process).
    auto group = init_process_group(gloo(r, 2, store).group_name("pair"));
    std::vector<at::Tensor> sum{torch::full({3}, r + 1.0)};
    group->allreduce(sum)->wait();
    std::vector<at::Tensor> hand{torch::full({2}, 7.0)};
    if (r == 0) {
      group->send(hand, 1, 0)->wait();
    } else {
      hand[0].zero_();
      group->recv(hand, 0, 0)->wait();
    }
    return std::make_tuple(group->getRank(), group->getSize(), sum[0], hand[0],
                           group->getGroupName());
  };
  auto zero = std::async(std::launch::async, rank, 0);
  auto one = std::async(std::launch::async, rank, 1);
  auto [r0, size0, sum0, hand0, name0] = zero.get();
  auto [r1, size1, sum1, hand1, name1] = one.get();
  CHECK(r0 == 0);
  CHECK(r1 == 1);
  CHECK(size0 == 2);
  CHECK(size1 == 2);
  CHECK(torch::equal(sum0, torch::full({3}, 3.0)));
  CHECK(torch::equal(sum1, torch::full({3}, 3.0)));
  CHECK(torch::equal(hand1, torch::full({2}, 7.0)));
  CHECK(name0 == "pair");
  CHECK(name1 == "pair");
}

TEST_CASE("process_group: unnamed groups are numbered per process", "[process_group]") {
  if (!gpipe::distributed::has_backend("gloo")) return;  // the refusal: the first case
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto first = init_process_group(gloo(0, 1, store))->getGroupName();
  const auto second = init_process_group(gloo(0, 1, store))->getGroupName();
  CHECK(first.rfind("gpipe_", 0) == 0);
  CHECK(second == "gpipe_" + std::to_string(std::stoll(first.substr(6)) + 1));
}

TEST_CASE("process_group: rank and world size from the environment", "[process_group]") {
  if (!gpipe::distributed::has_backend("gloo")) return;  // the refusal: the case above
  ScopedEnv rank("RANK", "0");
  ScopedEnv world("WORLD_SIZE", "1");
  auto group = init_process_group(
      ProcessGroupOptions().store(c10::make_intrusive<c10d::HashStore>()));
  CHECK(group->getRank() == 0);
  CHECK(group->getSize() == 1);
  CHECK(group->getBackendName() == "gloo");
}

TEST_CASE("process_group: bad settings are refused, naming the value and the fix",
          "[process_group]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  CHECK_THAT(error_of(gloo(0, 1, store).backend("mpi")),
             Catch::Contains("backend is \"mpi\"") && Catch::Contains("\"gloo\""));
  CHECK_THAT(error_of(gloo(2, 2, store)),
             Catch::Contains("rank is 2 but world_size is 2") &&
                 Catch::Contains("from 0 to 1"));
  CHECK_THAT(error_of(gloo(0, 0, store)), Catch::Contains("world_size is 0"));
  CHECK_THAT(error_of(gloo(0, 1, store).timeout(std::chrono::milliseconds(0))),
             Catch::Contains("timeout is 0 ms"));
  {
    ScopedEnv rank("RANK", nullptr);
    CHECK_THAT(error_of(gloo(-1, 1, store)),
               Catch::Contains("$RANK is not set") && Catch::Contains("torchrun"));
  }
  {
    ScopedEnv rank("RANK", "one");
    CHECK_THAT(error_of(gloo(-1, 1, store)), Catch::Contains("$RANK is \"one\", not an integer"));
  }
  {
    ScopedEnv addr("MASTER_ADDR", nullptr);
    CHECK_THAT(error_of(gloo(0, 1, {})),
               Catch::Contains("MASTER_ADDR=<unset>") && Catch::Contains(".store("));
  }
  {
    ScopedEnv addr("MASTER_ADDR", "127.0.0.1");
    ScopedEnv port("MASTER_PORT", "70000");
    CHECK_THAT(error_of(gloo(0, 1, {})), Catch::Contains("$MASTER_PORT is \"70000\""));
  }
}

TEST_CASE("process_group: an NCCL group of one rank all_reduces on cuda:0",
          "[process_group][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("skipped: no CUDA device");
    return;
  }
  if (!gpipe::distributed::has_backend("nccl")) {
    CHECK_THAT(error_of(gloo(0, 1, c10::make_intrusive<c10d::HashStore>()).backend("nccl")),
               Catch::Contains("without NCCL"));
    WARN("this gpipe was built without NCCL: only its refusal was checked");
    return;
  }
  // One GPU holds one NCCL rank: a group of one, all_reduce and a barrier.
  auto group = init_process_group(
      gloo(0, 1, c10::make_intrusive<c10d::HashStore>()).backend("nccl").group_name("nccl1"));
  CHECK(group->getBackendName() == "nccl");
  std::vector<at::Tensor> sum{torch::full({4}, 2.0, torch::kCUDA)};
  group->allreduce(sum)->wait();
  CHECK(torch::equal(sum[0].cpu(), torch::full({4}, 2.0)));
}
