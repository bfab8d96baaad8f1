// test_pipe_rng.cpp — checkpointing is exact: recompute replays the random numbers of the cell's first forward.
#include "models.h"
#include "rng.h"

#include <gpipe/gpipe.h>

#include <ATen/CPUGeneratorImpl.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

using gpipe::Checkpoint;
using gpipe::PipeOptions;
using gpipe_test::check_param_grads;
using gpipe_test::deep_copy;
using gpipe_test::kTolerance;
using gpipe_test::max_abs_diff;
using gpipe_test::randn64;

namespace {

// Dropout(0.5) layers (and identities) on ones: out = x * prod(mask_d / 0.5),
// and d out.sum() / dx is that same product, provided backward sees the
// masks the forward drew. Every element is 0 or 2^dropouts, in both.
struct Layout {
  const char* name;
  int dropouts;
  std::vector<int64_t> balance;
};

torch::nn::Sequential dropouts_model(const Layout& layout) {
  using namespace torch::nn;
  if (layout.dropouts == 2) return Sequential(Dropout(0.5), Dropout(0.5));
  return Sequential(Dropout(0.5), Identity(), Dropout(0.5), Dropout(0.5));
}

void check_recompute_exact(Checkpoint mode) {
  const auto layout = GENERATE(Layout{"two stages, one dropout each", 2, {1, 1}},
                               Layout{"three stages, three dropouts", 3, {2, 1, 1}});
  CAPTURE(mode, layout.name);
  gpipe::Pipe pipe(dropouts_model(layout),
                   PipeOptions().balance(layout.balance).chunks(4).checkpoint(mode));
  const double kept = std::pow(2.0, layout.dropouts);

  int64_t zeros = 0;
  int64_t nonzeros = 0;
  for (int iteration = 0; iteration < 200; ++iteration) {
    auto x = torch::ones({8, 16}, torch::kFloat64).requires_grad_(true);
    auto out = pipe->forward(x);
    out.sum().backward();
    REQUIRE(x.grad().defined());
    // Exact, elementwise: the masks are replayed, not redrawn.
    if (!torch::equal(x.grad(), out.detach())) {
      FAIL_CHECK("iteration " << iteration << ": input grad differs from output in "
                              << (x.grad() != out).sum().item<int64_t>() << " of "
                              << out.numel() << " elements");
    }
    REQUIRE(((out == 0) | (out == kept)).all().item<bool>());
    zeros += (out == 0).sum().item<int64_t>();
    nonzeros += (out == kept).sum().item<int64_t>();
  }
  // The dropouts really drop and really keep (the check above could not
  // fail otherwise).
  CHECK(zeros > 0);
  CHECK(nonzeros > 0);
}

}  // namespace

TEST_CASE("rng: recompute replays dropout masks exactly, checkpoint always", "[rng]") {
  check_recompute_exact(Checkpoint::Always);
}

TEST_CASE("rng: recompute replays dropout masks exactly, checkpoint except_last", "[rng]") {
  check_recompute_exact(Checkpoint::ExceptLast);
}

TEST_CASE("rng: a draw mark changes exactly when the generator's state does", "[rng]") {
  using gpipe::detail::DrawMark;
  using gpipe::detail::get_state;
  using gpipe::detail::same_state;
  at::Generator gen = at::detail::createCPUGenerator(7);
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  const DrawMark start(gen);
  const auto start_state = get_state(gen);
  CHECK(start == DrawMark(gen));
  // Another generator in the same state marks the same.
  CHECK(start == DrawMark(at::detail::createCPUGenerator(7)));
  SECTION("one uniform draw") {
    static_cast<void>(cpu->random());
  }
  SECTION("a full turn of the engine (left and next back where they were)") {
    for (int k = 0; k < 624; ++k) static_cast<void>(cpu->random());
  }
  SECTION("only a cached normal sample taken") {
    cpu->set_next_double_normal_sample(0.25);
    const DrawMark cached(gen);
    CHECK_FALSE(cached == start);
    cpu->set_next_double_normal_sample(std::nullopt);
    CHECK(DrawMark(gen) == start);
    cpu->set_next_float_normal_sample(0.5F);
  }
  SECTION("a tensor op drawing from it") {
    static_cast<void>(at::rand({3}, gen));
  }
  CHECK_FALSE(DrawMark(gen) == start);
  CHECK_FALSE(same_state(get_state(gen), start_state));
}

TEST_CASE("rng: one micro-batch draws what the Sequential draws", "[rng]") {
  // With one micro-batch the stages run one after the other, so the Pipe
  // draws its dropout masks in the Sequential's order: from the same seed
  // it must give the same output and grads, and must leave the generator
  // where the Sequential leaves it (recompute puts the live state back).
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  const auto balance = GENERATE(std::vector<int64_t>{5}, std::vector<int64_t>{2, 2, 1});
  CAPTURE(mode, balance);
  torch::manual_seed(11);
  using namespace torch::nn;
  Sequential model(Linear(6, 8), Dropout(0.5), Linear(8, 8), Dropout(0.3), Linear(8, 2));
  model->to(torch::kFloat64);
  auto ref = deep_copy(model);
  gpipe::Pipe pipe(model, PipeOptions().balance(balance).chunks(1).checkpoint(mode));
  const auto x = randn64({5, 6});

  auto x_ref = x.clone().requires_grad_(true);
  torch::manual_seed(5);
  auto out_ref = ref->forward(x_ref);
  out_ref.pow(2).sum().backward();
  const auto next_ref = torch::rand({8}, torch::kFloat64);

  auto x_pipe = x.clone().requires_grad_(true);
  torch::manual_seed(5);
  auto out_pipe = pipe->forward(x_pipe);
  out_pipe.pow(2).sum().backward();
  const auto next_pipe = torch::rand({8}, torch::kFloat64);

  CHECK(max_abs_diff(out_pipe, out_ref) <= kTolerance);
  CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
  CHECK(torch::equal(next_pipe, next_ref));
}

TEST_CASE("rng: checkpoint modes agree when a single stage draws", "[rng]") {
  // Only stage 1 draws, so its masks come in micro-batch order whatever the
  // other stages do: from one seed, checkpoint always and except_last must
  // give exactly the output and grads of checkpoint never (which keeps the
  // graph of the forward it ran), parameters included.
  torch::manual_seed(21);
  using namespace torch::nn;
  Sequential model(Linear(6, 8), Tanh(), Dropout(0.5), Linear(8, 8), Dropout(0.2), Linear(8, 2));
  model->to(torch::kFloat64);
  const auto x = randn64({11, 6});
  const auto w = randn64({11, 2});

  auto run = [&](Checkpoint mode) {
    auto copy = deep_copy(model);
    gpipe::Pipe pipe(copy, PipeOptions().balance({2, 3, 1}).chunks(4).checkpoint(mode));
    auto xr = x.clone().requires_grad_(true);
    torch::manual_seed(99);
    auto out = pipe->forward(xr);
    (out * w).sum().backward();
    return std::make_tuple(gpipe::Pipe(pipe), out.detach(), xr.grad());
  };
  auto [never, out_never, grad_never] = run(Checkpoint::Never);
  for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
    CAPTURE(mode);
    auto [pipe, out, grad] = run(mode);
    CHECK(max_abs_diff(out, out_never) <= kTolerance);
    CHECK(max_abs_diff(grad, grad_never) <= kTolerance);
    check_param_grads(*pipe, *never);
  }
  // A different seed draws different masks: the comparison above can fail.
  auto other = deep_copy(model);
  gpipe::Pipe pipe(other, PipeOptions().balance({2, 3, 1}).chunks(4));
  torch::manual_seed(100);
  CHECK(max_abs_diff(pipe->forward(x), out_never) > 1e-3);
}

namespace {

/// Dropout(0.5) only on micro-batches of fewer than `rows` rows (the last,
/// smaller one): a stage that draws on some cells and not on others.
class DropoutWhenSmallImpl : public torch::nn::Cloneable<DropoutWhenSmallImpl> {
 public:
  explicit DropoutWhenSmallImpl(int64_t rows) : rows_(rows) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x.size(0) < rows_ ? torch::dropout(x, 0.5, is_training()) : x * 1.0;
  }

 private:
  int64_t rows_;
};
TORCH_MODULE(DropoutWhenSmall);

}  // namespace

TEST_CASE("a layer that draws on some micro-batches only replays exactly on every one") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast);
  INFO("checkpoint " << mode);
  // 7 rows, 4 chunks: micro-batches of 2, 2, 2, 1 rows; only the last draws.
  // Two such stages, so the second's snapshot is taken while the first may
  // draw, and an identity in front so the drawing cell is not alone.
  torch::nn::Sequential model(torch::nn::Identity(), DropoutWhenSmall(2), DropoutWhenSmall(2));
  for (int call = 0; call < 3; ++call) {
    INFO("call " << call);
    gpipe::Pipe pipe(deep_copy(model), PipeOptions().balance({2, 1}).chunks(4).checkpoint(mode));
    for (int again = 0; again < 3; ++again) {
      auto x = torch::ones({7, 64}, torch::kFloat64).requires_grad_(true);
      auto out = pipe->forward(x);
      out.sum().backward();
      // out = x * masks / 0.25 and so is d out.sum() / dx, if the replay
      // drew the forward's masks.
      CHECK(max_abs_diff(x.grad(), out.detach()) <= kTolerance);
      CHECK(out.slice(0, 0, 6).eq(1.0).all().item<bool>());
    }
  }
}

// ---- seeded runs are reproducible (issue 22 item 4) -------------------------------
//
// Four CPU stages on four workers, dropout in three of them, four
// micro-batches: the stages draw at once. The same seed must give bitwise the
// same outputs, loss and grads on every run, whatever the threads' timing.

namespace {

/// x @ other.weight^T: uses a weight of another layer (in another stage),
/// which it does not register: a weight tied across stages.
class TiedLinearImpl : public torch::nn::Cloneable<TiedLinearImpl> {
 public:
  explicit TiedLinearImpl(torch::nn::Linear other) : other_(std::move(other)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(other_->weight.t()); }

 private:
  torch::nn::Linear other_;
};
TORCH_MODULE(TiedLinear);

constexpr int64_t kWidth = 96;

/// 8 layers, balance {2, 2, 2, 2}: dropout in stages 0, 1 and 3 (stage 2
/// draws nothing), float32 (where summation order shows most). `tied`: the
/// last layer reuses the first Linear's weight, and no layer draws (the
/// grads' summation order alone is on trial).
torch::nn::Sequential drawing_model(bool tied) {
  using namespace torch::nn;
  torch::manual_seed(17);
  Linear first(kWidth, kWidth);
  auto drop = [tied](double p) { return tied ? AnyModule(Identity()) : AnyModule(Dropout(p)); };
  Sequential model(first);
  model->push_back(drop(0.3));
  model->push_back(Linear(kWidth, kWidth));
  model->push_back(drop(0.5));
  model->push_back(Linear(kWidth, kWidth));
  model->push_back(Tanh());
  model->push_back(drop(0.2));
  if (tied) {
    model->push_back(TiedLinear(first));
  } else {
    model->push_back(Linear(kWidth, kWidth));
  }
  return model;
}

gpipe::PipeOptions four_cpu_stages(Checkpoint mode, int64_t chunks) {
  return PipeOptions()
      .balance({2, 2, 2, 2})
      .devices(std::vector<c10::Device>(4, torch::kCPU))
      .chunks(chunks)
      .checkpoint(mode);
}

/// Everything a run leaves: outputs (or losses), the input's grad, every
/// parameter's grad, and the generator's next numbers.
struct Outcome {
  std::vector<torch::Tensor> tensors;
};

void check_bitwise_equal(const Outcome& a, const Outcome& b, int run) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t k = 0; k < a.tensors.size(); ++k) {
    INFO("run " << run << ", tensor " << k << " of " << a.tensors.size());
    REQUIRE(a.tensors[k].defined() == b.tensors[k].defined());
    if (a.tensors[k].defined()) CHECK(torch::equal(a.tensors[k], b.tensors[k]));
  }
}

void keep_grads(const torch::nn::Module& module, Outcome& out) {
  for (const auto& p : module.parameters()) out.tensors.push_back(p.grad().clone());
}

// Two drop-in steps (forward, backward) from one seed on a fresh Pipe.
Outcome drop_in_run(Checkpoint mode, bool tied, int64_t chunks) {
  gpipe::Pipe pipe(drawing_model(tied), four_cpu_stages(mode, chunks));
  Outcome out;
  torch::manual_seed(1234);
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({64, kWidth}).requires_grad_(true);
    auto y = pipe->forward(x);
    (y * y).sum().backward();
    out.tensors.push_back(y.detach());
    out.tensors.push_back(x.grad());
  }
  keep_grads(*pipe, out);
  out.tensors.push_back(torch::rand({4}));
  return out;
}

// Two train_steps from one seed on a fresh Pipe.
Outcome train_step_run(gpipe::Schedule schedule, Checkpoint mode, bool tied) {
  auto options = four_cpu_stages(mode, 4).schedule(schedule);
  if (schedule == gpipe::Schedule::Interleaved1F1B) {
    options.devices(std::vector<c10::Device>(2, torch::kCPU)).virtual_stages(2);
  }
  gpipe::Pipe pipe(drawing_model(tied), options);
  Outcome out;
  torch::manual_seed(1234);
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({64, kWidth}).requires_grad_(true);
    auto target = torch::randn({64, kWidth});
    out.tensors.push_back(pipe->train_step(x, target, [](const torch::Tensor& o,
                                                         const torch::Tensor& t) {
      return torch::mse_loss(o, t);
    }));
    out.tensors.push_back(x.grad());
  }
  keep_grads(*pipe, out);
  out.tensors.push_back(torch::rand({4}));
  return out;
}

constexpr int kRuns = 4;

}  // namespace

TEST_CASE("rng: a seeded drop-in run is bitwise reproducible, 4 CPU stages drawing at once",
          "[rng]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(mode);
  const Outcome first = drop_in_run(mode, /*tied=*/false, 4);
  for (int run = 1; run < kRuns; ++run) check_bitwise_equal(first, drop_in_run(mode, false, 4), run);
}

TEST_CASE("rng: a seeded train_step is bitwise reproducible in every schedule", "[rng]") {
  const auto schedule = GENERATE(gpipe::Schedule::GPipe, gpipe::Schedule::OneFOneB,
                                 gpipe::Schedule::Interleaved1F1B, gpipe::Schedule::ZBH1);
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never);
  CAPTURE(schedule, mode);
  const Outcome first = train_step_run(schedule, mode, /*tied=*/false);
  for (int run = 1; run < kRuns; ++run) {
    check_bitwise_equal(first, train_step_run(schedule, mode, false), run);
  }
}

TEST_CASE("rng: a weight tied across CPU stages gets bitwise the same grad on every run",
          "[rng]") {
  const auto mode = GENERATE(Checkpoint::Always, Checkpoint::Never);
  CAPTURE(mode);
  SECTION("drop-in") {
    const Outcome first = drop_in_run(mode, /*tied=*/true, 4);
    for (int run = 1; run < kRuns; ++run) check_bitwise_equal(first, drop_in_run(mode, true, 4), run);
  }
  SECTION("train_step") {
    const auto schedule = GENERATE(gpipe::Schedule::OneFOneB, gpipe::Schedule::ZBH1);
    CAPTURE(schedule);
    const Outcome first = train_step_run(schedule, mode, /*tied=*/true);
    for (int run = 1; run < kRuns; ++run) {
      check_bitwise_equal(first, train_step_run(schedule, mode, true), run);
    }
  }
}

// ---- a stage that draws nothing runs its cells at once with the others ---------------------
//
// A cell that does not know yet whether its stage draws takes the shared
// generator to itself (the RNG rule, rng.h), so it runs alone. Learning that
// once per step made every stage's first cell of every step run alone: on
// K workers about K cells of each step were serialized (issue 26 item 1).

namespace {

/// Two cells that should be able to run at once: each one that arrives
/// waits, up to two seconds, until both are inside.
struct Meeting {
  std::mutex mutex;
  std::condition_variable changed;
  int inside = 0;
  bool together = false;  // both were inside at once
  int met = 0;            // cells that saw it
  bool armed = false;
};

/// Identity that meets on the micro-batch whose first element is
/// `microbatch`, while the meeting is armed (in forwards, not recomputes).
class MeetImpl : public torch::nn::Cloneable<MeetImpl> {
 public:
  MeetImpl(std::shared_ptr<Meeting> meeting, double microbatch)
      : meeting_(std::move(meeting)), microbatch_(microbatch) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (gpipe::is_recomputing() || x[0][0].item<double>() != microbatch_) return x;
    std::unique_lock<std::mutex> hold(meeting_->mutex);
    if (!meeting_->armed) return x;
    if (++meeting_->inside == 2) meeting_->together = true;
    meeting_->changed.notify_all();
    if (meeting_->changed.wait_for(hold, std::chrono::seconds(2),
                                   [&] { return meeting_->together; })) {
      ++meeting_->met;
    }
    --meeting_->inside;
    return x;
  }

 private:
  std::shared_ptr<Meeting> meeting_;
  double microbatch_;
};
TORCH_MODULE(Meet);

}  // namespace

TEST_CASE("rng: from its second step on, a stage that draws nothing runs at once with the others",
          "[rng]") {
  const auto mode = GENERATE(Checkpoint::Never, Checkpoint::Always);
  CAPTURE(mode);
  // Two CPU stages, two micro-batches (rows of 0s, then of 1s): stage 1's
  // first cell and stage 0's second are due at the same time.
  auto meeting = std::make_shared<Meeting>();
  gpipe::Pipe pipe(torch::nn::Sequential(Meet(meeting, 1.0), Meet(meeting, 0.0)),
                   PipeOptions()
                       .balance({1, 1})
                       .devices({torch::kCPU, torch::kCPU})
                       .chunks(2)
                       .checkpoint(mode));
  auto x = torch::cat({torch::zeros({2, 4}), torch::ones({2, 4})}).requires_grad_(true);
  pipe->forward(x).sum().backward();  // the first step learns that nothing draws
  for (int step = 1; step < 3; ++step) {
    INFO("step " << step);
    {
      std::lock_guard<std::mutex> hold(meeting->mutex);
      meeting->armed = true;
      meeting->together = false;
      meeting->met = 0;
    }
    pipe->forward(x).sum().backward();
    std::lock_guard<std::mutex> hold(meeting->mutex);
    CHECK(meeting->met == 2);
  }
}

TEST_CASE("rng: a stage back in training after an eval step draws from its cells' own streams",
          "[rng]") {
  // Its dropouts drew nothing in eval mode; in training they must draw
  // again from each cell's stream, as on a fresh Pipe, not from the live
  // generator in the threads' order.
  const auto mode = GENERATE(Checkpoint::Never, Checkpoint::Always);
  CAPTURE(mode);
  torch::manual_seed(2);
  const auto x = torch::randn({32, kWidth});
  gpipe::Pipe fresh(drawing_model(false), four_cpu_stages(mode, 4));
  torch::manual_seed(3);
  const auto want = fresh->forward(x);

  gpipe::Pipe pipe(drawing_model(false), four_cpu_stages(mode, 4));
  pipe->eval();
  {
    torch::NoGradGuard no_grad;
    pipe->forward(x);
  }
  pipe->forward(x);  // eval with a graph: still nothing drawn
  pipe->train();
  torch::manual_seed(3);
  CHECK(torch::equal(pipe->forward(x), want));
}
