// test_distributed_pipe.cpp — gpipe::DistributedPipe on a group of one rank (every stage local; the multi-rank runs are tests/python/test_distributed.py's).
#include <gpipe/distributed_pipe.h>

#include "models.h"

namespace {

torch::nn::Sequential mlp() {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(6, 6), torch::nn::Tanh(), torch::nn::Linear(6, 6),
                              torch::nn::Tanh());
  model->to(torch::kFloat64);
  return model;
}

c10::intrusive_ptr<c10d::ProcessGroup> one_rank() {
  return c10::make_intrusive<c10d::ProcessGroup>(/*rank=*/0, /*size=*/1);
}

}  // namespace

TEST_CASE("distributed_pipe: one rank's step equals the plain Sequential's", "[distributed]") {
  for (auto [schedule, v] : {std::pair{gpipe::Schedule::OneFOneB, 1},
                             std::pair{gpipe::Schedule::Interleaved1F1B, 2},
                             std::pair{gpipe::Schedule::ZBH1, 1}}) {
    auto model = mlp();
    auto plain = mlp();
    gpipe::DistributedPipe pipe(model, gpipe::DistributedPipeOptions(v == 1 ? std::vector<int64_t>{4}
                                                                            : std::vector<int64_t>{2, 2})
                                           .chunks(3)
                                           .schedule(schedule)
                                           .virtual_stages(v)
                                           .group(one_rank()));
    CHECK(pipe->is_first());
    CHECK(pipe->is_last());
    CHECK(pipe->rank() == 0);
    auto x = torch::randn({7, 6}, torch::kFloat64);
    auto y = torch::randn({7, 6}, torch::kFloat64);
    auto loss = pipe->train_step(x, y, [](const torch::Tensor& out, const torch::Tensor& t) {
      return torch::mse_loss(out, t);
    });
    auto expected = torch::mse_loss(plain->forward(x), y);
    expected.backward();
    CHECK((loss - expected.detach()).abs().item<double>() <= 1e-10);
    const auto ours = pipe->named_parameters();
    const auto theirs = plain->named_parameters();
    REQUIRE(ours.size() == theirs.size());
    for (const auto& p : theirs) {
      REQUIRE(ours.contains(p.key()));
      CHECK((ours[p.key()].grad() - p.value().grad()).abs().max().item<double>() <= 1e-10);
    }
    torch::NoGradGuard no_grad;
    CHECK((pipe->eval_step(x) - plain->forward(x)).abs().max().item<double>() <= 1e-10);
  }
}

TEST_CASE("distributed_pipe: bad options name the value and the fix", "[distributed]") {
  auto model = mlp();
  CHECK_THROWS_WITH(gpipe::DistributedPipe(model, gpipe::DistributedPipeOptions({2, 2})
                                                      .group(one_rank())),
                    "balance has 2 stages but the group has 1 ranks x virtual_stages 1 = 1 "
                    "stages; pass 1 entries");
  CHECK_THROWS_WITH(gpipe::DistributedPipe(model, gpipe::DistributedPipeOptions({4})),
                    Catch::Contains("has no group"));
  gpipe::DistributedPipe pipe(model, gpipe::DistributedPipeOptions({4}).chunks(4).group(one_rank()));
  CHECK_THROWS_WITH(
      pipe->train_step(torch::randn({3, 6}, torch::kFloat64), torch::randn({3, 6}, torch::kFloat64),
                       [](const torch::Tensor& out, const torch::Tensor& t) {
                         return torch::mse_loss(out, t);
                       }),
      "the input makes 3 micro-batches but every rank of the pipeline runs chunks=4; give at "
      "least 4 rows");
}
