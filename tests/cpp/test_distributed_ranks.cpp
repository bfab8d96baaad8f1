// test_distributed_ranks.cpp — what the ranks of a gpipe::DistributedPipe must share (threads on fake process groups): settings that differ are refused on every rank, naming each rank's value; a weight tied across ranks trains as the plain model's single weight.
#include <gpipe/distributed_pipe.h>

#include "fake_group.h"
#include "models.h"
#include "ranks.h"

#include <torch/optim/sgd.h>

#include <array>
#include <functional>
#include <map>

using namespace gpipe_test;
using gpipe::Checkpoint;
using gpipe::Schedule;

namespace {

using namespace std::chrono_literals;

constexpr int64_t kWidth = 6;

/// Eight layers whose first and last share one weight; the same values
/// every call (each rank builds its own, as every process would).
torch::nn::Sequential tied_model() {
  torch::manual_seed(11);
  auto w = (randn64({kWidth, kWidth}) * 0.5).requires_grad_(true);
  torch::nn::Sequential model(Tied(w), torch::nn::Linear(kWidth, kWidth), torch::nn::Tanh(),
                              torch::nn::Linear(kWidth, kWidth), torch::nn::Tanh(),
                              torch::nn::Linear(kWidth, kWidth), torch::nn::Tanh(), Tied(w));
  model->to(torch::kFloat64);
  return model;
}

torch::nn::Sequential eight_layers(int64_t width = kWidth) {
  torch::manual_seed(3);
  torch::nn::Sequential model;
  for (int k = 0; k < 4; ++k) {
    model->push_back(torch::nn::Linear(kWidth, k == 1 ? width : kWidth));
    if (k == 1 && width != kWidth) model->push_back(torch::nn::Linear(width, kWidth));
    model->push_back(torch::nn::Tanh());
  }
  model->to(torch::kFloat64);
  return model;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& t) {
  return torch::mse_loss(out, t);
}

// Every rank builds a pipe with the options `options_of(rank)` makes (from
// its own model): every rank must fail, and each message must hold `want`.
void check_refused(int ranks, const std::function<torch::nn::Sequential(int)>& model_of,
                   const std::function<gpipe::DistributedPipeOptions(int)>& options_of,
                   const std::vector<std::string>& want) {
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < ranks; ++r) models.push_back(model_of(r));
  const auto errors = run_ranks(ranks, [&](int rank) {
    gpipe::DistributedPipe dp(models[static_cast<size_t>(rank)], options_of(rank));
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<size_t>(r)]);
    for (const auto& text : want) CHECK_THAT(errors[static_cast<size_t>(r)], Catch::Contains(text));
  }
}

}  // namespace

TEST_CASE("distributed_pipe: ranks that disagree on a setting or a layer all refuse, naming each "
          "rank's value", "[distributed]") {
  const int ranks = 4;
  for (auto matching : {FakeMatching::ByTag, FakeMatching::ByOrder}) {
    INFO((matching == FakeMatching::ByTag ? "by tag" : "by order"));
    auto same = [](int) { return eight_layers(); };
    auto options = [&](std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups) {
      return [groups](int rank) {
        return gpipe::DistributedPipeOptions({2, 2, 2, 2})
            .chunks(4)
            .group(groups[static_cast<size_t>(rank)]);
      };
    };
    SECTION("balance") {
      auto groups = make_fake_groups(ranks, matching, 10s);
      check_refused(ranks, same, [&](int rank) {
        return options(groups)(rank).balance(rank == 0 ? std::vector<int64_t>{3, 1, 2, 2}
                                                       : std::vector<int64_t>{2, 2, 2, 2});
      }, {"disagree on 1 setting", "balance: rank 0 has [3, 1, 2, 2]; ranks 1, 2 and 3 have "
                                   "[2, 2, 2, 2]"});
    }
    SECTION("schedule and chunks") {
      auto groups = make_fake_groups(ranks, matching, 10s);
      check_refused(ranks, same, [&](int rank) {
        auto o = options(groups)(rank);
        if (rank == 2) o.schedule(Schedule::GPipe).chunks(3);
        return o;
      }, {"disagree on 2 settings", "chunks: ranks 0, 1 and 3 have 4; rank 2 has 3",
          "schedule: ranks 0, 1 and 3 have 1f1b; rank 2 has gpipe"});
    }
    SECTION("a layer's parameters") {
      auto groups = make_fake_groups(ranks, matching, 10s);
      // Rank 3 builds a layer 2 of another width (and so one layer more).
      check_refused(ranks, [](int rank) { return eight_layers(rank == 3 ? 5 : kWidth); },
                    [&](int rank) {
                      return options(groups)(rank).balance(
                          rank == 3 ? std::vector<int64_t>{2, 3, 2, 2}
                                    : std::vector<int64_t>{2, 2, 2, 2});
                    },
                    {"layer 2: ranks 0, 1 and 2 have weight [6, 6] Double",
                     "rank 3 has weight [5, 6] Double",
                     "layer 8: ranks 0, 1 and 2 have (nothing)"});
    }
  }
}

TEST_CASE("distributed_pipe: ranks that agree build and train (the exchange costs two "
          "all_reduces)", "[distributed]") {
  const int ranks = 2;
  const auto groups = make_fake_groups(ranks, FakeMatching::ByTag, 10s);
  std::vector<torch::nn::Sequential> models{eight_layers(), eight_layers()};
  const auto x = randn64({4, kWidth});
  const auto errors = run_ranks(ranks, [&](int rank) {
    gpipe::DistributedPipe dp(models[static_cast<size_t>(rank)],
                              gpipe::DistributedPipeOptions({4, 4}).chunks(2).group(
                                  groups[static_cast<size_t>(rank)]));
    dp->train_step(dp->is_first() ? x : torch::Tensor(), dp->is_last() ? x : torch::Tensor(), mse);
  });
  CHECK(errors == std::vector<std::string>(ranks));
}

TEST_CASE("distributed_pipe: a weight tied across ranks starts as the lowest owner's and trains "
          "as the plain model's one weight, every schedule", "[distributed]") {
  const int steps = 3;
  const double lr = 0.1;
  for (int ranks : {2, 4}) {
    for (auto [schedule, v] : {std::pair{Schedule::GPipe, 1}, std::pair{Schedule::OneFOneB, 1},
                               std::pair{Schedule::Interleaved1F1B, 2},
                               std::pair{Schedule::ZBH1, 1}}) {
      if (ranks == 4 && v == 2) continue;  // 8 stages of one layer: covered by 2 x 2 below
      for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
        INFO(ranks << " ranks, " << schedule << ", virtual_stages " << v << ", " << mode);
        const int64_t stages = ranks * v;
        const std::vector<int64_t> balance(static_cast<size_t>(stages), 8 / stages);
        torch::manual_seed(5);
        std::vector<torch::Tensor> xs, ys;
        for (int k = 0; k < steps; ++k) {
          xs.push_back(randn64({8, kWidth}));
          ys.push_back(randn64({8, kWidth}));
        }

        auto plain = tied_model();
        // C++ lists a tied tensor under each of its names: once for the optimizer.
        std::vector<torch::Tensor> unique;
        for (const auto& p : plain->parameters()) {
          bool seen = false;
          for (const auto& u : unique) seen |= u.is_same(p);
          if (!seen) unique.push_back(p);
        }
        torch::optim::SGD plain_opt(unique, lr);
        std::vector<torch::Tensor> plain_losses;
        for (int k = 0; k < steps; ++k) {
          plain_opt.zero_grad();
          auto loss = mse(plain->forward(xs[k]), ys[k]);
          loss.backward();
          plain_opt.step();
          plain_losses.push_back(loss.detach());
        }

        std::vector<torch::nn::Sequential> models;
        for (int r = 0; r < ranks; ++r) {
          models.push_back(tied_model());
          // A replica that starts off: the lowest owner's values win.
          if (r == ranks - 1) {
            torch::NoGradGuard no_grad;
            models.back()->ptr(7)->named_parameters()["weight"].add_(1.0);
          }
        }
        const auto groups = make_fake_groups(ranks, FakeMatching::ByTag, 10s);
        std::vector<std::map<std::string, torch::Tensor>> params(static_cast<size_t>(ranks));
        std::vector<std::vector<torch::Tensor>> losses(static_cast<size_t>(ranks));
        const auto errors = run_ranks(ranks, [&](int rank) {
          gpipe::DistributedPipe dp(models[static_cast<size_t>(rank)],
                                    gpipe::DistributedPipeOptions(balance)
                                        .chunks(4)
                                        .schedule(schedule)
                                        .virtual_stages(v)
                                        .checkpoint(mode)
                                        .group(groups[static_cast<size_t>(rank)]));
          torch::optim::SGD opt(dp->parameters(), lr);
          for (int k = 0; k < steps; ++k) {
            opt.zero_grad();
            auto loss = dp->train_step(dp->is_first() ? xs[k] : torch::Tensor(),
                                       dp->is_last() ? ys[k] : torch::Tensor(), mse);
            opt.step();
            losses[static_cast<size_t>(rank)].push_back(loss);
          }
          for (const auto& p : dp->named_parameters()) {
            params[static_cast<size_t>(rank)][p.key()] = p.value().detach().clone();
          }
        });
        REQUIRE(errors == std::vector<std::string>(static_cast<size_t>(ranks)));
        const auto plain_params = plain->named_parameters();
        for (int k = 0; k < steps; ++k) {
          CHECK(max_abs_diff(losses[static_cast<size_t>(ranks - 1)][static_cast<size_t>(k)],
                             plain_losses[static_cast<size_t>(k)]) <= kTolerance);
        }
        for (int r = 0; r < ranks; ++r) {
          for (const auto& [name, value] : params[static_cast<size_t>(r)]) {
            INFO("rank " << r << ", parameter " << name);
            CHECK(max_abs_diff(value, plain_params[name]) <= kTolerance);
          }
        }
        // The replicas are bitwise equal.
        CHECK(params.front().at("0.weight").equal(params.back().at("7.weight")));
      }
    }
  }
}

TEST_CASE("distributed_pipe: a bad argument on one rank stops every rank before anything is sent, "
          "and the pipe trains on (also across data-parallel replicas)", "[distributed]") {
  // 2 pipelines of 2 ranks x 2 replicas: thread t is rank t % 2 of pipeline
  // t / 2. Step 1: rank 1 of pipeline 1 gives a target of 2 rows for 8
  // input rows. Step 2: every argument right.
  const int threads = 4;
  for (auto matching : {FakeMatching::ByTag, FakeMatching::ByOrder}) {
    INFO((matching == FakeMatching::ByTag ? "by tag" : "by order"));
    std::array<std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>, 2> pipelines{
        make_fake_groups(2, matching, 10s), make_fake_groups(2, matching, 10s)};
    std::array<std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>, 2> reverse;
    if (matching == FakeMatching::ByOrder) {
      reverse = {make_fake_groups(2, matching, 10s), make_fake_groups(2, matching, 10s)};
    }
    const std::array<std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>, 2> data{
        make_fake_groups(2, FakeMatching::ByTag, 10s),
        make_fake_groups(2, FakeMatching::ByTag, 10s)};
    std::vector<torch::nn::Sequential> models;
    for (int t = 0; t < threads; ++t) models.push_back(eight_layers());
    const auto x = randn64({8, kWidth});
    std::vector<std::string> first(threads), second(threads);
    const auto errors = run_ranks(threads, [&](int t) {
      const int pipeline = t / 2;
      const int rank = t % 2;
      auto options = gpipe::DistributedPipeOptions({4, 4})
                         .chunks(4)
                         .group(pipelines[static_cast<size_t>(pipeline)][static_cast<size_t>(rank)])
                         .dp_group(data[static_cast<size_t>(rank)][static_cast<size_t>(pipeline)]);
      if (!reverse[0].empty()) {
        options.reverse_group(reverse[static_cast<size_t>(pipeline)][static_cast<size_t>(rank)]);
      }
      gpipe::DistributedPipe dp(models[static_cast<size_t>(t)], options);
      const bool bad = pipeline == 1 && rank == 1;
      try {
        dp->train_step(dp->is_first() ? x : torch::Tensor(),
                       dp->is_last() ? (bad ? x.slice(0, 0, 2) : x) : torch::Tensor(), mse);
      } catch (const std::exception& e) {
        first[static_cast<size_t>(t)] = e.what();
      }
      auto loss = dp->train_step(dp->is_first() ? x : torch::Tensor(),
                                 dp->is_last() ? x : torch::Tensor(), mse);
      second[static_cast<size_t>(t)] = dp->is_last() ? (loss.defined() ? "loss" : "none") : "";
    });
    REQUIRE(errors == std::vector<std::string>(threads));
    const std::string rows = "the target makes 2 micro-batches but every rank of the pipeline "
                             "runs chunks=4";
    CHECK_THAT(first[3], Catch::StartsWith(rows));
    CHECK_THAT(first[2], Catch::StartsWith("rank 1's train_step got bad arguments (" + rows));
    for (int t : {0, 1}) {
      CHECK_THAT(first[static_cast<size_t>(t)],
                 Catch::StartsWith("a data-parallel replica's train_step got bad arguments"));
    }
    CHECK(second == std::vector<std::string>{"", "loss", "", "loss"});
  }
}

TEST_CASE("distributed_pipe: a target cut unlike the input is refused on every rank before "
          "anything is sent", "[distributed]") {
  const int ranks = 4;
  const auto groups = make_fake_groups(ranks, FakeMatching::ByTag, 10s);
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < ranks; ++r) models.push_back(eight_layers());
  const auto x = randn64({16, kWidth});
  std::vector<std::string> first(ranks);
  const auto errors = run_ranks(ranks, [&](int rank) {
    gpipe::DistributedPipe dp(models[static_cast<size_t>(rank)],
                              gpipe::DistributedPipeOptions({2, 2, 2, 2}).chunks(4).group(
                                  groups[static_cast<size_t>(rank)]));
    try {
      dp->train_step(dp->is_first() ? x : torch::Tensor(),
                     dp->is_last() ? x.slice(0, 0, 4) : torch::Tensor(), mse);
    } catch (const std::exception& e) {
      first[static_cast<size_t>(rank)] = e.what();
    }
    dp->train_step(dp->is_first() ? x : torch::Tensor(), dp->is_last() ? x : torch::Tensor(), mse);
  });
  REQUIRE(errors == std::vector<std::string>(ranks));
  for (const auto& e : first) {
    CHECK(e == "train_step's target has 4 rows along dim 0 (cut into [1, 1, 1, 1]) but the input "
               "has 16 along its batch dim (cut into [4, 4, 4, 4]); the target is cut like the "
               "input: give one target row per input row");
  }
}

TEST_CASE("ties: replaced replicas are what later steps sum (FSDP2's unsharded copies), a "
          "wrong count or size is refused", "[distributed]") {
  const auto groups = make_fake_groups(2, FakeMatching::ByTag, 10s);
  std::array<torch::Tensor, 2> sums;
  std::array<torch::Tensor, 2> originals;
  std::array<std::string, 2> refusals;
  const auto errors = run_ranks(2, [&](int rank) {
    const auto r = static_cast<size_t>(rank);
    gpipe::detail::Tie tie;
    tie.uses = {"0.weight", "7.weight"};
    tie.owners = {0, 1};
    tie.sizes = {2, 3};
    tie.dtype = torch::kFloat64;
    tie.requires_grad = true;
    originals[r] = torch::zeros({2, 3}, torch::kFloat64).requires_grad_(true);
    tie.replica = originals[r];
    gpipe::detail::TiedParameters ties({tie}, *groups[r], c10::Device(c10::kCPU));
    try {
      ties.set_replicas({});
    } catch (const c10::Error& e) {
      refusals[r] = e.what_without_backtrace();
    }
    try {
      ties.set_replicas({torch::zeros({3, 2}, torch::kFloat64)});
    } catch (const c10::Error& e) {
      refusals[r] += std::string(" | ") + e.what_without_backtrace();
    }
    auto copy = torch::zeros({2, 3}, torch::kFloat64).requires_grad_(true);
    ties.set_replicas({copy});
    ties.begin_step();
    copy.mutable_grad() = torch::full({2, 3}, double(rank + 1), torch::kFloat64);
    ties.reduce_grads();
    sums[r] = copy.grad();
  });
  REQUIRE(errors == std::vector<std::string>(2));
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << refusals[r]);
    CHECK(sums[r].equal(torch::full({2, 3}, 3.0, torch::kFloat64)));
    // The replaced replica takes no part any more.
    CHECK(!originals[r].grad().defined());
    CHECK_THAT(refusals[r], Catch::Contains("got 0 tensors for 1 tied parameters"));
    CHECK_THAT(refusals[r], Catch::Contains("must have its sizes [2, 3], got [3, 2]"));
  }
}
