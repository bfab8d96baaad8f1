// test_distributed_ranks.cpp — what the ranks of a gpipe::DistributedPipe must share (threads on fake process groups): settings that differ are refused on every rank, naming each rank's value; a weight tied across ranks trains as the plain model's single weight.
#include <gpipe/distributed_pipe.h>

#include "fake_group.h"
#include "models.h"

#include <torch/optim/sgd.h>

#include <functional>
#include <map>

using namespace gpipe_test;
using gpipe::Checkpoint;
using gpipe::Schedule;

namespace {

using namespace std::chrono_literals;

constexpr int64_t kWidth = 6;

/// tanh(x W^T) with a W it is given: one use of a weight tied to another
/// layer's (a GPT's embedding and lm_head).
class TiedImpl : public torch::nn::Cloneable<TiedImpl> {
 public:
  explicit TiedImpl(torch::Tensor w) : w_(std::move(w)) { reset(); }
  void reset() override { weight = register_parameter("weight", w_); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(x.matmul(weight.t())); }
  torch::Tensor weight;

 private:
  torch::Tensor w_;
};
TORCH_MODULE(Tied);

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

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); }

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
                    {"layer 2: ranks 0, 1 and 2 have LinearImpl: weight [6, 6] Double",
                     "rank 3 has LinearImpl: weight [5, 6] Double", "layer 8: ranks 0, 1 and 2 have "
                                                                "(nothing)"});
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
