// test_distributed_pipe.cpp — gpipe::DistributedPipe over 1, 2 and 4 ranks (threads on fake process groups): every schedule and checkpoint mode equals gpipe::Pipe and the plain Sequential; skips across ranks; tuple steps; pipelines x data-parallel replicas (dp_group); eval; failures reach every rank.
#include <gpipe/distributed_pipe.h>

#include "fake_group.h"
#include "models.h"

#include <array>
#include <map>
#include <sstream>

using namespace gpipe_test;
using gpipe::Checkpoint;
using gpipe::Schedule;

namespace {

using namespace std::chrono_literals;

constexpr int64_t kWidth = 6;

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

/// tanh(Linear(x)); stashes x under `name`.
class StashImpl : public torch::nn::Cloneable<StashImpl>, public gpipe::Skippable {
 public:
  explicit StashImpl(std::string name) : gpipe::Skippable({.stash = {name}}), name_(std::move(name)) {
    reset();
  }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    linear->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    stash(name_, x);
    return torch::tanh(linear(x));
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::string name_;
};
TORCH_MODULE(Stash);

/// tanh(Linear(x)) + what `name` carried, halved.
class PopImpl : public torch::nn::Cloneable<PopImpl>, public gpipe::Skippable {
 public:
  explicit PopImpl(std::string name) : gpipe::Skippable({.pop = {name}}), name_(std::move(name)) {
    reset();
  }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    linear->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(linear(x)) + 0.5 * pop(name_); }
  torch::nn::Linear linear{nullptr};

 private:
  std::string name_;
};
TORCH_MODULE(Pop);

/// Throws in forward.
class FailingImpl : public torch::nn::Cloneable<FailingImpl> {
 public:
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    throw std::runtime_error("layer failed on purpose");
    return x;
  }
};
TORCH_MODULE(Failing);

// Eight layers, so that every layout of 2 or 4 ranks x 1 or 2 virtual
// stages has whole layers per stage.
torch::nn::Sequential eight_layers() {
  torch::manual_seed(3);
  torch::nn::Sequential model;
  for (int k = 0; k < 4; ++k) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    model->push_back(torch::nn::Tanh());
  }
  model->to(torch::kFloat64);
  return model;
}

// Residual-style skips: 0 -> 3 and 2 -> 6, each crossing ranks in every
// layout but one stage (8 stages of one layer: every skip crosses).
torch::nn::Sequential eight_with_skips() {
  torch::manual_seed(4);
  torch::nn::Sequential model(Stash("a"), torch::nn::Tanh(), Stash("b"), Pop("a"),
                              torch::nn::Tanh(), torch::nn::Linear(kWidth, kWidth), Pop("b"),
                              torch::nn::Tanh());
  model->to(torch::kFloat64);
  return model;
}

// A copy of `model`, safe off the main thread (deep_copy REQUIREs).
torch::nn::Sequential copy_of(const torch::nn::Sequential& model) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); }

// What one rank's step gave.
struct RankResult {
  torch::Tensor loss;
  torch::Tensor eval;
  std::map<std::string, torch::Tensor> grads;
  bool first = false;
  bool last = false;
};

struct Layout {
  int ranks;
  Schedule schedule;
  int64_t virtual_stages;
  Checkpoint checkpoint;
};

std::string describe(const Layout& l, bool skips) {
  std::ostringstream s;
  s << l.ranks << " ranks, " << l.schedule << ", virtual_stages " << l.virtual_stages << ", "
    << l.checkpoint << (skips ? ", skips" : "");
  return s.str();
}

// Groups for one run: the pipeline's, and (for NCCL-like matching) a
// reverse. `like_nccl`: works as NCCL's (fake_group.h: wait does not
// block, abort tears the group down).
struct FakeGroups {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> pipeline;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> reverse;  // empty: none
};

FakeGroups fake_groups(int ranks, FakeMatching matching, std::chrono::milliseconds timeout = 20s,
                       bool like_nccl = false) {
  FakeGroups g;
  g.pipeline = make_fake_groups(ranks, matching, timeout, "", like_nccl);
  if (matching == FakeMatching::ByOrder) {
    g.reverse = make_fake_groups(ranks, matching, timeout, "", like_nccl);
  }
  return g;
}

gpipe::DistributedPipeOptions options_for(const Layout& l, const std::vector<int64_t>& balance,
                                          int64_t chunks, const FakeGroups& groups, int rank) {
  auto options = gpipe::DistributedPipeOptions(balance)
                     .chunks(chunks)
                     .schedule(l.schedule)
                     .virtual_stages(l.virtual_stages)
                     .checkpoint(l.checkpoint)
                     .group(groups.pipeline[static_cast<size_t>(rank)]);
  if (!groups.reverse.empty()) options.reverse_group(groups.reverse[static_cast<size_t>(rank)]);
  return options;
}

// Every layout, schedule and mode: each rank's grads and the loss equal
// gpipe::Pipe's train_step and the plain Sequential's loss.backward(); the
// last rank's eval_step equals the Sequential's forward.
void check_equal_to_pipe_and_plain(FakeMatching matching, bool like_nccl = false) {
  const int64_t chunks = 3;  // 7 rows: micro-batches of 3, 2, 2
  for (bool skips : {false, true}) {
    const auto model = skips ? eight_with_skips() : eight_layers();
    for (int ranks : {2, 4}) {
      for (auto [schedule, v] : {std::pair{Schedule::GPipe, 1}, std::pair{Schedule::OneFOneB, 1},
                                 std::pair{Schedule::Interleaved1F1B, 2},
                                 std::pair{Schedule::ZBH1, 1}, std::pair{Schedule::ZBV, 2}}) {
        for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
          const Layout layout{ranks, schedule, v, mode};
          INFO(describe(layout, skips));
          const int64_t stages = ranks * v;
          const std::vector<int64_t> balance(static_cast<size_t>(stages), 8 / stages);
          torch::manual_seed(5);
          const auto x = randn64({7, kWidth});
          const auto y = randn64({7, kWidth});

          auto plain = copy_of(model);
          auto expected = mse(plain->forward(x), y);
          expected.backward();
          torch::Tensor expected_out;
          {
            torch::NoGradGuard no_grad;
            expected_out = plain->forward(x);
          }

          auto pipe_model = copy_of(model);
          gpipe::Pipe pipe(pipe_model, gpipe::PipeOptions()
                                           .balance(balance)
                                           .devices(std::vector<c10::Device>(
                                               static_cast<size_t>(ranks), torch::kCPU))
                                           .chunks(chunks)
                                           .schedule(schedule)
                                           .virtual_stages(v)
                                           .checkpoint(mode));
          const auto pipe_loss = pipe->train_step(x, y, mse);

          std::vector<torch::nn::Sequential> copies;
          for (int r = 0; r < ranks; ++r) copies.push_back(copy_of(model));
          const auto groups = fake_groups(ranks, matching, 20s, like_nccl);
          std::vector<RankResult> results(static_cast<size_t>(ranks));
          const auto errors = run_ranks(ranks, [&](int rank) {
            gpipe::DistributedPipe dp(copies[static_cast<size_t>(rank)],
                                      options_for(layout, balance, chunks, groups, rank));
            auto& out = results[static_cast<size_t>(rank)];
            out.first = dp->is_first();
            out.last = dp->is_last();
            out.loss = dp->train_step(dp->is_first() ? x : torch::Tensor(),
                                      dp->is_last() ? y : torch::Tensor(), mse);
            for (const auto& p : dp->named_parameters()) out.grads[p.key()] = p.value().grad();
            out.eval = dp->eval_step(dp->is_first() ? x : torch::Tensor());
          });
          REQUIRE(errors == std::vector<std::string>(static_cast<size_t>(ranks)));

          const auto plain_params = plain->named_parameters();
          const auto pipe_params = pipe->named_parameters();
          size_t seen = 0;
          for (int r = 0; r < ranks; ++r) {
            const auto& out = results[static_cast<size_t>(r)];
            INFO("rank " << r);
            CHECK(out.first == (r == 0));
            // ZB-V's V brings the last stage back to rank 0.
            CHECK(out.last == (r == (schedule == Schedule::ZBV ? 0 : ranks - 1)));
            if (out.last) {
              CHECK(max_abs_diff(out.loss, expected.detach()) <= kTolerance);
              CHECK(max_abs_diff(out.loss, pipe_loss) <= kTolerance);
              CHECK(max_abs_diff(out.eval, expected_out) <= kTolerance);
            } else {
              CHECK_FALSE(out.loss.defined());
              CHECK_FALSE(out.eval.defined());
            }
            for (const auto& [name, grad] : out.grads) {
              INFO("parameter " << name);
              REQUIRE(plain_params.contains(name));
              CHECK(max_abs_diff(grad, plain_params[name].grad()) <= kTolerance);
              CHECK(max_abs_diff(grad, pipe_params[name].grad()) <= kTolerance);
            }
            seen += out.grads.size();
          }
          CHECK(seen == plain_params.size());  // every parameter on exactly one rank
        }
      }
    }
  }
}

// A failure on one rank fails the step on every rank, naming that rank,
// within a deadline well under the groups' timeout (no rank waits it out).
void check_failure_reaches_every_rank(FakeMatching matching, bool like_nccl = false) {
  const int ranks = 4;
  for (bool in_loss : {true, false}) {
    INFO((in_loss ? "loss_fn throws on the last rank" : "a layer throws on rank 1"));
    auto model = eight_layers();
    // Layer 2 is rank 1's first under {2, 2, 2, 2}.
    torch::nn::Sequential layers;
    size_t k = 0;
    for (const auto& any : *model) {
      if (!in_loss && k == 2) {
        layers->push_back(Failing());
      } else {
        layers->push_back(any);
      }
      ++k;
    }
    const int failing = in_loss ? ranks - 1 : 1;
    std::vector<torch::nn::Sequential> copies;
    for (int r = 0; r < ranks; ++r) copies.push_back(copy_of(layers));
    const auto groups = fake_groups(ranks, matching, /*timeout=*/8s, like_nccl);
    const Layout layout{ranks, Schedule::OneFOneB, 1, Checkpoint::ExceptLast};
    const auto x = randn64({8, kWidth});
    const auto start = Clock::now();
    const auto errors = run_ranks(ranks, [&](int rank) {
      gpipe::DistributedPipe dp(copies[static_cast<size_t>(rank)],
                                options_for(layout, {2, 2, 2, 2}, 4, groups, rank));
      dp->train_step(dp->is_first() ? x : torch::Tensor(), dp->is_last() ? x : torch::Tensor(),
                     [&](const torch::Tensor& out, const torch::Tensor&) -> torch::Tensor {
                       if (in_loss) throw std::runtime_error("loss failed on purpose");
                       return out.sum();
                     });
    });
    CHECK(Clock::now() - start < 6s);
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r << ": " << errors[static_cast<size_t>(r)]);
      CHECK_THAT(errors[static_cast<size_t>(r)],
                 Catch::Contains(in_loss ? "loss failed on purpose" : "layer failed on purpose"));
      if (r != failing) {
        CHECK_THAT(errors[static_cast<size_t>(r)],
                   Catch::Contains("rank " + std::to_string(failing) + " failed"));
      }
    }
  }
}


// ---- several tensors between stages -----------------------------------------

/// Takes (a, b), returns (tanh(A a + b), (B b) * tanh(a)): both outputs
/// depend on both inputs, so a hand-off that swaps or drops one shows.
class PairImpl : public torch::nn::Cloneable<PairImpl> {
 public:
  PairImpl() { reset(); }
  void reset() override {
    a = register_module("a", torch::nn::Linear(kWidth, kWidth));
    b = register_module("b", torch::nn::Linear(kWidth, kWidth));
    to(torch::kFloat64);
  }
  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> in) {
    return {torch::tanh(a(in[0]) + in[1]), b(in[1]) * torch::tanh(in[0])};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Pair);

/// Takes one tensor x, returns (tanh(L x), x): a single input, a tuple out.
class ForkImpl : public torch::nn::Cloneable<ForkImpl> {
 public:
  ForkImpl() { reset(); }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    linear->to(torch::kFloat64);
  }
  std::vector<torch::Tensor> forward(const torch::Tensor& x) { return {torch::tanh(linear(x)), x}; }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Fork);

// Eight Pairs: (a, b) in, (a', b') out, tuples across every rank boundary.
torch::nn::Sequential eight_pairs() {
  torch::manual_seed(6);
  torch::nn::Sequential model;
  for (int k = 0; k < 8; ++k) model->push_back(Pair());
  return model;
}

torch::Tensor pair_loss(const std::vector<torch::Tensor>& out, const std::vector<torch::Tensor>& t) {
  return torch::mse_loss(out[0], t[0]) + 0.5 * torch::mse_loss(out[1], t[1]);
}

std::vector<torch::Tensor> plain_forward(torch::nn::Sequential model,
                                         std::vector<torch::Tensor> h) {
  for (auto& layer : *model) h = layer.forward<std::vector<torch::Tensor>>(h);
  return h;
}

// train_step_tuple and eval_step_tuple over 2 and 4 ranks: each rank's
// grads and the loss equal the plain Sequential's; every output of the last
// rank's eval equals the plain forward's, other ranks get none.
void check_tuple_steps(FakeMatching matching) {
  const int64_t chunks = 3;  // 7 rows: micro-batches of 3, 2, 2
  const auto model = eight_pairs();
  for (int ranks : {2, 4}) {
    for (auto [schedule, v] : {std::pair{Schedule::OneFOneB, 1},
                               std::pair{Schedule::Interleaved1F1B, 2},
                               std::pair{Schedule::ZBH1, 1}, std::pair{Schedule::ZBV, 2}}) {
      const Layout layout{ranks, schedule, v, Checkpoint::ExceptLast};
      INFO(describe(layout, false) << ", tuples");
      const int64_t stages = ranks * v;
      const std::vector<int64_t> balance(static_cast<size_t>(stages), 8 / stages);
      torch::manual_seed(7);
      const std::vector<torch::Tensor> inputs{randn64({7, kWidth}), randn64({7, kWidth})};
      const std::vector<torch::Tensor> targets{randn64({7, kWidth}), randn64({7, kWidth})};

      auto plain = copy_of(model);
      auto expected = pair_loss(plain_forward(plain, inputs), targets);
      expected.backward();
      std::vector<torch::Tensor> expected_out;
      {
        torch::NoGradGuard no_grad;
        expected_out = plain_forward(plain, inputs);
      }

      std::vector<torch::nn::Sequential> copies;
      for (int r = 0; r < ranks; ++r) copies.push_back(copy_of(model));
      const auto groups = fake_groups(ranks, matching);
      std::vector<RankResult> results(static_cast<size_t>(ranks));
      std::vector<std::vector<torch::Tensor>> evals(static_cast<size_t>(ranks));
      const auto errors = run_ranks(ranks, [&](int rank) {
        gpipe::DistributedPipe dp(copies[static_cast<size_t>(rank)],
                                  options_for(layout, balance, chunks, groups, rank));
        auto& out = results[static_cast<size_t>(rank)];
        out.last = dp->is_last();
        out.loss = dp->train_step_tuple(dp->is_first() ? inputs : std::vector<torch::Tensor>{},
                                        dp->is_last() ? targets : std::vector<torch::Tensor>{},
                                        pair_loss);
        for (const auto& p : dp->named_parameters()) out.grads[p.key()] = p.value().grad();
        evals[static_cast<size_t>(rank)] =
            dp->eval_step_tuple(dp->is_first() ? inputs : std::vector<torch::Tensor>{});
      });
      REQUIRE(errors == std::vector<std::string>(static_cast<size_t>(ranks)));

      const auto plain_params = plain->named_parameters();
      size_t seen = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto& out = results[static_cast<size_t>(r)];
        const auto& eval = evals[static_cast<size_t>(r)];
        INFO("rank " << r);
        CHECK(out.last == (r == (schedule == Schedule::ZBV ? 0 : ranks - 1)));
        if (out.last) {
          CHECK(max_abs_diff(out.loss, expected.detach()) <= kTolerance);
          REQUIRE(eval.size() == expected_out.size());
          for (size_t k = 0; k < eval.size(); ++k) {
            INFO("output " << k);
            CHECK(max_abs_diff(eval[k], expected_out[k]) <= kTolerance);
          }
        } else {
          CHECK_FALSE(out.loss.defined());
          CHECK(eval.empty());
        }
        for (const auto& [name, grad] : out.grads) {
          INFO("parameter " << name);
          REQUIRE(plain_params.contains(name));
          CHECK(max_abs_diff(grad, plain_params[name].grad()) <= kTolerance);
        }
        seen += out.grads.size();
      }
      CHECK(seen == plain_params.size());
    }
  }
}

// A Sequential returning a tuple, trained or evaluated by the one-tensor
// calls: the last rank's error points at the tuple call; no rank hangs.
void check_single_tensor_call_on_tuple_output(FakeMatching matching) {
  const int ranks = 2;
  torch::manual_seed(8);
  torch::nn::Sequential model{Fork(), Pair()};
  const Layout layout{ranks, Schedule::OneFOneB, 1, Checkpoint::ExceptLast};
  const auto x = randn64({4, kWidth});
  for (bool train : {true, false}) {
    INFO((train ? "train_step" : "eval_step"));
    std::vector<torch::nn::Sequential> copies;
    for (int r = 0; r < ranks; ++r) copies.push_back(copy_of(model));
    const auto groups = fake_groups(ranks, matching, /*timeout=*/8s);
    const auto start = Clock::now();
    const auto errors = run_ranks(ranks, [&](int rank) {
      gpipe::DistributedPipe dp(copies[static_cast<size_t>(rank)],
                                options_for(layout, {1, 1}, 2, groups, rank));
      if (train) {
        dp->train_step(dp->is_first() ? x : torch::Tensor(), dp->is_last() ? x : torch::Tensor(),
                       mse);
      } else {
        dp->eval_step(dp->is_first() ? x : torch::Tensor());
      }
    });
    CHECK(Clock::now() - start < 6s);
    INFO("rank 0: " << errors[0] << "\nrank 1: " << errors[1]);
    CHECK_THAT(errors[1], Catch::Contains("returned 2 tensors") &&
                              Catch::Contains(train ? "call train_step_tuple" : "call eval_step_tuple"));
    // A training step fails on every rank; an eval's output is checked on
    // the last rank only, after the step.
    if (train) CHECK_FALSE(errors[0].empty());
  }
}


// ---- pipeline x data parallelism --------------------------------------------

// 4 threads = 2 pipelines of 2 ranks (threads {0, 1} and {2, 3}) x 2
// replicas of each stage (threads {0, 2} and {1, 3}): thread r is rank r % 2
// of pipeline r / 2 and rank r / 2 of data group r % 2.
struct PpDp {
  Schedule schedule;
  int64_t virtual_stages;
  FakeMatching matching;   // the pipelines'; the data groups match by tag (Gloo)
  double bucket_cap_mb;    // 0: the default
  bool frozen;             // layer 2's weight requires no grad
};

std::string describe(const PpDp& c) {
  std::ostringstream s;
  s << c.schedule << ", virtual_stages " << c.virtual_stages << ", pipelines "
    << (c.matching == FakeMatching::ByTag ? "by tag" : "by order") << ", bucket_cap_mb "
    << (c.bucket_cap_mb > 0 ? std::to_string(c.bucket_cap_mb) : std::string("default"))
    << (c.frozen ? ", layer 2's weight frozen" : "");
  return s.str();
}

// Each pipeline trains on its half of a batch, twice (two batches, grads
// not zeroed between): after each step every thread's grads equal the plain
// Sequential's after loss.backward() on the whole batches (equal halves, so
// the whole batch's mean loss is the halves' average), and each pipeline's
// loss is its half's.
void check_pp_dp(const PpDp& c) {
  INFO(describe(c));
  constexpr int kThreads = 4;
  const int64_t chunks = 2;  // halves of 4 rows: micro-batches of 2
  const auto model = eight_layers();
  auto freeze = [&](const torch::nn::Sequential& m) {
    if (c.frozen) m->ptr(2)->named_parameters()["weight"].requires_grad_(false);
  };
  const int64_t stages = 2 * c.virtual_stages;
  const std::vector<int64_t> balance(static_cast<size_t>(stages), 8 / stages);
  torch::manual_seed(9);
  const std::vector<torch::Tensor> xs{randn64({8, kWidth}), randn64({8, kWidth})};
  const std::vector<torch::Tensor> ys{randn64({8, kWidth}), randn64({8, kWidth})};
  auto half = [](const torch::Tensor& t, int pipeline) { return t.narrow(0, 4 * pipeline, 4); };

  auto plain = copy_of(model);
  freeze(plain);
  std::vector<torch::Tensor> expected_loss;
  std::vector<std::map<std::string, torch::Tensor>> expected_grads;
  std::vector<std::array<torch::Tensor, 2>> expected_half_loss;
  for (size_t step = 0; step < 2; ++step) {
    auto loss = mse(plain->forward(xs[step]), ys[step]);
    loss.backward();
    expected_loss.push_back(loss.detach());
    std::map<std::string, torch::Tensor> grads;
    for (const auto& p : plain->named_parameters()) {
      grads[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor();
    }
    expected_grads.push_back(std::move(grads));
    torch::NoGradGuard no_grad;
    expected_half_loss.push_back({mse(plain->forward(half(xs[step], 0)), half(ys[step], 0)),
                                  mse(plain->forward(half(xs[step], 1)), half(ys[step], 1))});
  }

  std::vector<torch::nn::Sequential> copies;
  for (int r = 0; r < kThreads; ++r) {
    copies.push_back(copy_of(model));  // clone() resets requires_grad: freeze each copy
    freeze(copies.back());
  }
  const std::array<FakeGroups, 2> pipelines{fake_groups(2, c.matching), fake_groups(2, c.matching)};
  const std::array<std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>, 2> data{
      make_fake_groups(2, FakeMatching::ByTag), make_fake_groups(2, FakeMatching::ByTag)};
  const Layout layout{2, c.schedule, c.virtual_stages, Checkpoint::ExceptLast};
  // [thread][step]
  std::vector<std::array<RankResult, 2>> results(kThreads);
  const auto errors = run_ranks(kThreads, [&](int thread) {
    const int pipeline = thread / 2;
    auto options = options_for(layout, balance, chunks, pipelines[static_cast<size_t>(pipeline)],
                               thread % 2)
                       .dp_group(data[static_cast<size_t>(thread % 2)][static_cast<size_t>(pipeline)]);
    if (c.bucket_cap_mb > 0) options.bucket_cap_mb(c.bucket_cap_mb);
    gpipe::DistributedPipe dp(copies[static_cast<size_t>(thread)], options);
    for (size_t step = 0; step < 2; ++step) {
      auto& out = results[static_cast<size_t>(thread)][step];
      out.first = dp->is_first();
      out.last = dp->is_last();
      out.loss = dp->train_step(dp->is_first() ? half(xs[step], pipeline) : torch::Tensor(),
                                dp->is_last() ? half(ys[step], pipeline) : torch::Tensor(), mse);
      for (const auto& p : dp->named_parameters()) {
        const auto& g = p.value().grad();
        out.grads[p.key()] = g.defined() ? g.clone() : torch::Tensor();
      }
    }
  });
  REQUIRE(errors == std::vector<std::string>(kThreads));

  for (size_t step = 0; step < 2; ++step) {
    INFO("after step " << step + 1);
    std::map<std::string, int> holders;
    std::array<torch::Tensor, 2> pipeline_loss;
    for (int thread = 0; thread < kThreads; ++thread) {
      INFO("thread " << thread);
      const auto& out = results[static_cast<size_t>(thread)][step];
      CHECK(out.first == (thread % 2 == 0));
      // ZB-V's V brings the last stage back to the first rank.
      CHECK(out.last == (thread % 2 == (c.schedule == Schedule::ZBV ? 0 : 1)));
      if (out.last) {
        const int pipeline = thread / 2;
        CHECK(max_abs_diff(out.loss, expected_half_loss[step][static_cast<size_t>(pipeline)]) <=
              kTolerance);
        pipeline_loss[static_cast<size_t>(pipeline)] = out.loss;
      } else {
        CHECK_FALSE(out.loss.defined());
      }
      for (const auto& [name, grad] : out.grads) {
        INFO("parameter " << name);
        REQUIRE(expected_grads[step].contains(name));
        const auto& want = expected_grads[step].at(name);
        CHECK(grad.defined() == want.defined());
        CHECK(max_abs_diff(grad, want) <= kTolerance);
        ++holders[name];
      }
    }
    if (pipeline_loss[0].defined() && pipeline_loss[1].defined()) {
      CHECK(max_abs_diff((pipeline_loss[0] + pipeline_loss[1]) / 2, expected_loss[step]) <=
            kTolerance);
    }
    // Every parameter on one rank of each pipeline.
    CHECK(holders.size() == expected_grads[step].size());
    for (const auto& [name, count] : holders) {
      INFO("parameter " << name);
      CHECK(count == 2);
    }
    if (c.frozen) CHECK_FALSE(expected_grads[step].at("2.weight").defined());
  }
}

void check_pp_dp_every_schedule(FakeMatching matching) {
  for (auto [schedule, v] : {std::pair{Schedule::OneFOneB, 1},
                             std::pair{Schedule::Interleaved1F1B, 2},
                             std::pair{Schedule::ZBH1, 1}, std::pair{Schedule::ZBV, 2}}) {
    // 1e-6 MiB (1 byte): one bucket per parameter.
    for (double cap : {0.0, 1e-6}) check_pp_dp({schedule, v, matching, cap, false});
  }
}

}  // namespace

TEST_CASE("distributed_pipe: one rank's step equals the plain Sequential's", "[distributed]") {
  for (auto [schedule, v] : {std::pair{gpipe::Schedule::OneFOneB, 1},
                             std::pair{gpipe::Schedule::Interleaved1F1B, 2},
                             std::pair{gpipe::Schedule::ZBH1, 1},
                             std::pair{gpipe::Schedule::ZBV, 2}}) {
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
  CHECK_THROWS_WITH(gpipe::DistributedPipe(model, gpipe::DistributedPipeOptions({1, 1, 1, 1})
                                                      .schedule(gpipe::Schedule::ZBV)
                                                      .virtual_stages(4)
                                                      .group(one_rank())),
                    "virtual_stages is 4 but schedule zb_v runs two stages per rank; leave "
                    "virtual_stages at 1 or pass 2");
  CHECK_THROWS_WITH(gpipe::DistributedPipe(model, gpipe::DistributedPipeOptions({2, 2})
                                                      .virtual_stages(2)
                                                      .group(one_rank())),
                    "virtual_stages is 2 but schedule 1f1b runs one stage per rank; use "
                    "Schedule::Interleaved1F1B, or virtual_stages 1");
  gpipe::DistributedPipe pipe(model, gpipe::DistributedPipeOptions({4}).chunks(4).group(one_rank()));
  CHECK_THROWS_WITH(
      pipe->train_step(torch::randn({3, 6}, torch::kFloat64), torch::randn({3, 6}, torch::kFloat64),
                       [](const torch::Tensor& out, const torch::Tensor& t) {
                         return torch::mse_loss(out, t);
                       }),
      "the input makes 3 micro-batches but every rank of the pipeline runs chunks=4; give at "
      "least 4 rows");
}

TEST_CASE("distributed_pipe: 2 and 4 ranks by tag (Gloo-like) equal Pipe and the Sequential, "
          "every schedule and mode, with and without skips across ranks",
          "[distributed]") {
  check_equal_to_pipe_and_plain(FakeMatching::ByTag);
}

TEST_CASE("distributed_pipe: a failing rank fails every rank by tag (Gloo-like), naming it",
          "[distributed]") {
  check_failure_reaches_every_rank(FakeMatching::ByTag);
}

// NCCL-like matching with a reverse group: the transport's ordered hand-offs
// (any backend but Gloo).
TEST_CASE("distributed_pipe: 2 and 4 ranks by order (NCCL-like, reverse group) equal Pipe and "
          "the Sequential, every schedule and mode, with and without skips across ranks",
          "[distributed][ordered]") {
  check_equal_to_pipe_and_plain(FakeMatching::ByOrder);
}

TEST_CASE("distributed_pipe: a failing rank fails every rank by order (NCCL-like), naming it",
          "[distributed][ordered]") {
  check_failure_reaches_every_rank(FakeMatching::ByOrder);
}

// With works that behave as NCCL's (a wait that does not block the host, an
// abort that fails every op of the group): the transport polls, and never
// aborts, so results and failures are the same as above.
TEST_CASE("distributed_pipe: by order with NCCL's works (wait does not block, abort tears the "
          "group down): equal to Pipe and the Sequential, every schedule and mode",
          "[distributed][ordered]") {
  check_equal_to_pipe_and_plain(FakeMatching::ByOrder, /*like_nccl=*/true);
}

TEST_CASE("distributed_pipe: by order with NCCL's works, a failing rank fails every rank, naming "
          "it, within seconds",
          "[distributed][ordered]") {
  check_failure_reaches_every_rank(FakeMatching::ByOrder, /*like_nccl=*/true);
}

// Why the reverse group: NCCL-like matching runs a pair's sends and
// receives on one in-order queue, so without it rank 0's early receive of
// a grad holds up its first activation send, which rank 1 waits for. The
// step must fail (the group's timeout), not hang.
TEST_CASE("distributed_pipe: by order without a reverse group, the hand-offs wait on each "
          "other and the step fails at the group's timeout",
          "[distributed][ordered]") {
  const int ranks = 2;
  const auto model = eight_layers();
  const Layout layout{ranks, Schedule::OneFOneB, 1, Checkpoint::Never};
  FakeGroups groups;
  groups.pipeline = make_fake_groups(ranks, FakeMatching::ByOrder, 2s);
  std::vector<torch::nn::Sequential> copies;
  for (int r = 0; r < ranks; ++r) copies.push_back(copy_of(model));
  torch::manual_seed(5);
  const auto x = randn64({4, kWidth});
  const auto y = randn64({4, kWidth});
  const auto errors = run_ranks(ranks, [&](int rank) {
    gpipe::DistributedPipe dp(copies[static_cast<size_t>(rank)],
                              options_for(layout, {4, 4}, 4, groups, rank));
    dp->train_step(dp->is_first() ? x : torch::Tensor(), dp->is_last() ? y : torch::Tensor(),
                   mse);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<size_t>(r)]);
    CHECK_FALSE(errors[static_cast<size_t>(r)].empty());
  }
  const std::string both = errors[0] + errors[1];
  CHECK(both.find("timeout") != std::string::npos);
}

TEST_CASE("distributed_pipe: several inputs and outputs (train_step_tuple, eval_step_tuple) on 2 "
          "and 4 ranks by tag (Gloo-like) equal the Sequential",
          "[distributed]") {
  check_tuple_steps(FakeMatching::ByTag);
}

TEST_CASE("distributed_pipe: several inputs and outputs (train_step_tuple, eval_step_tuple) on 2 "
          "and 4 ranks by order (NCCL-like, reverse group) equal the Sequential",
          "[distributed][ordered]") {
  check_tuple_steps(FakeMatching::ByOrder);
}

TEST_CASE("distributed_pipe: train_step or eval_step on a Sequential returning a tuple fails, "
          "pointing at the tuple call, by tag (Gloo-like)",
          "[distributed]") {
  check_single_tensor_call_on_tuple_output(FakeMatching::ByTag);
}

TEST_CASE("distributed_pipe: train_step or eval_step on a Sequential returning a tuple fails, "
          "pointing at the tuple call, by order (NCCL-like)",
          "[distributed][ordered]") {
  check_single_tensor_call_on_tuple_output(FakeMatching::ByOrder);
}

TEST_CASE("distributed_pipe: 2 pipelines x 2 replicas (dp_group, by tag) train as one replica on "
          "the whole batch, every schedule, default and one-parameter buckets, two steps "
          "accumulating",
          "[distributed]") {
  check_pp_dp_every_schedule(FakeMatching::ByTag);
}

TEST_CASE("distributed_pipe: 2 pipelines (by order, NCCL-like, reverse groups) x 2 replicas "
          "(dp_group, by tag) train as one replica on the whole batch, every schedule, default "
          "and one-parameter buckets, two steps accumulating",
          "[distributed][ordered]") {
  check_pp_dp_every_schedule(FakeMatching::ByOrder);
}

TEST_CASE("distributed_pipe: with dp_group a frozen parameter keeps no grad on any replica, the "
          "others are averaged",
          "[distributed]") {
  for (auto [schedule, v] : {std::pair{Schedule::OneFOneB, 1},
                             std::pair{Schedule::Interleaved1F1B, 2},
                             std::pair{Schedule::ZBH1, 1}, std::pair{Schedule::ZBV, 2}}) {
    for (double cap : {0.0, 1e-6}) check_pp_dp({schedule, v, FakeMatching::ByTag, cap, true});
  }
}

void check_step_timeout(FakeMatching matching, bool like_nccl) {
  const int ranks = 4;
  // The group's own timeout is long: only step_timeout can end the waits early.
  const auto groups = fake_groups(ranks, matching, 20s, like_nccl);
  const auto stuck = 3000ms;
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(3);
    const auto nap = r == 2 ? stuck : 0ms;
    models.push_back(torch::nn::Sequential(
        torch::nn::Linear(kWidth, kWidth), torch::nn::Tanh(),
        torch::nn::Functional([nap](const torch::Tensor& x) {
          std::this_thread::sleep_for(nap);
          return x;
        }),
        torch::nn::Linear(kWidth, kWidth)));
    models.back()->to(torch::kFloat64);
  }
  torch::manual_seed(5);
  const auto x = randn64({4, kWidth});
  const auto y = randn64({4, kWidth});
  std::array<double, ranks> seconds{};
  const auto errors = run_ranks(ranks, [&](int rank) {
    auto options = gpipe::DistributedPipeOptions({1, 1, 1, 1})
                       .chunks(2)
                       .step_timeout(500ms)
                       .group(groups.pipeline[static_cast<size_t>(rank)]);
    if (!groups.reverse.empty()) options.reverse_group(groups.reverse[static_cast<size_t>(rank)]);
    gpipe::DistributedPipe dp(models[static_cast<size_t>(rank)], options);
    const auto start = std::chrono::steady_clock::now();
    try {
      dp->train_step(dp->is_first() ? x : torch::Tensor(), dp->is_last() ? y : torch::Tensor(),
                     [](const torch::Tensor& out, const torch::Tensor& t) {
                       return torch::mse_loss(out, t);
                     });
    } catch (...) {
      seconds[static_cast<size_t>(rank)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      throw;
    }
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << " after " << seconds[static_cast<size_t>(r)] << " s: "
                 << errors[static_cast<size_t>(r)]);
    CHECK(!errors[static_cast<size_t>(r)].empty());
  }
  // Rank 3 waits for stage 2's activations of micro-batch 0, from the stuck rank 2.
  INFO("rank 3: " << errors[3]);
  CHECK_THAT(errors[3], Catch::Contains("waited 0.5 s (the pipe's step_timeout)") &&
                            Catch::Contains("3F0") && Catch::Contains("from rank 2"));
  CHECK(seconds[3] < 2.5);
  // The stuck rank itself fails only once its layer returns.
  CHECK(seconds[2] >= 2.9);
}

TEST_CASE("distributed_pipe: step_timeout fails the ranks waiting on a stuck rank within it, "
          "naming the action and the rank they wait for, a negative one is refused",
          "[distributed]") {
  SECTION("by tag (Gloo-like)") { check_step_timeout(FakeMatching::ByTag, false); }
  SECTION("by order, NCCL's works") { check_step_timeout(FakeMatching::ByOrder, true); }
  std::vector<torch::nn::Sequential> models{torch::nn::Sequential(
      torch::nn::Linear(kWidth, kWidth), torch::nn::Linear(kWidth, kWidth))};
  // Refused before anything is sent (no peer takes part here).
  const auto pair = make_fake_groups(2, FakeMatching::ByTag, 5s);
  CHECK_THROWS_WITH(gpipe::DistributedPipe(models[0], gpipe::DistributedPipeOptions({1, 1})
                                                          .step_timeout(-1ms)
                                                          .group(pair[0])),
                    Catch::Contains("step_timeout must not be negative, got -1 ms"));
}

TEST_CASE("distributed_pipe: a CSV table placing its stages in a V (zb_v's, exported) runs in "
          "the V over 2 ranks, by tag and by order, as the plain Sequential",
          "[distributed]") {
  const auto model = eight_layers();
  const std::vector<int64_t> balance{2, 2, 2, 2};
  // The table the in-process zb_v runs for 2 devices and 4 micro-batches.
  auto exporter = copy_of(model);
  gpipe::Pipe named(exporter, gpipe::PipeOptions()
                                  .balance(balance)
                                  .devices({torch::kCPU, torch::kCPU})
                                  .chunks(4)
                                  .schedule(Schedule::ZBV));
  const std::string table = named->schedule_csv();
  torch::manual_seed(5);
  const auto x = randn64({8, kWidth});
  const auto y = randn64({8, kWidth});
  auto plain = copy_of(model);
  auto expected = mse(plain->forward(x), y);
  expected.backward();
  const auto plain_params = plain->named_parameters();
  for (auto matching : {FakeMatching::ByTag, FakeMatching::ByOrder}) {
    INFO((matching == FakeMatching::ByTag ? "by tag" : "by order"));
    std::vector<torch::nn::Sequential> copies{copy_of(model), copy_of(model)};
    const auto groups = fake_groups(2, matching);
    std::vector<RankResult> results(2);
    std::vector<std::vector<int64_t>> stages(2);
    std::vector<std::string> exported(2);
    const auto errors = run_ranks(2, [&](int rank) {
      auto options = gpipe::DistributedPipeOptions(balance)
                         .chunks(4)
                         .schedule_csv(table)
                         .group(groups.pipeline[static_cast<size_t>(rank)]);
      if (!groups.reverse.empty()) options.reverse_group(groups.reverse[static_cast<size_t>(rank)]);
      gpipe::DistributedPipe dp(copies[static_cast<size_t>(rank)], options);
      auto& out = results[static_cast<size_t>(rank)];
      out.first = dp->is_first();
      out.last = dp->is_last();
      stages[static_cast<size_t>(rank)] = dp->stages();
      exported[static_cast<size_t>(rank)] = dp->schedule_csv();
      out.loss = dp->train_step(dp->is_first() ? x : torch::Tensor(),
                                dp->is_last() ? y : torch::Tensor(), mse);
      for (const auto& p : dp->named_parameters()) out.grads[p.key()] = p.value().grad();
    });
    REQUIRE(errors == std::vector<std::string>(2));
    CHECK(stages[0] == std::vector<int64_t>{0, 3});
    CHECK(stages[1] == std::vector<int64_t>{1, 2});
    CHECK(results[0].first);
    CHECK(results[0].last);
    CHECK(exported[0] == table);
    CHECK(max_abs_diff(results[0].loss, expected.detach()) <= kTolerance);
    size_t seen = 0;
    for (const auto& r : results) {
      for (const auto& [name, grad] : r.grads) {
        INFO("parameter " << name);
        CHECK(max_abs_diff(grad, plain_params[name].grad()) <= kTolerance);
        ++seen;
      }
    }
    CHECK(seen == plain_params.size());
  }
}
