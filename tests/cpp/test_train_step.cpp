// test_train_step.cpp — train_step against the plain model for every schedule, checkpoint mode and chunking; its failures.
#include "models.h"

#include <cmath>
#include <string>
#include <tuple>

using namespace gpipe_test;

namespace {

using gpipe::Checkpoint;
using gpipe::Schedule;

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

struct Case {
  Schedule schedule;
  std::vector<int64_t> balance;
  int64_t devices;  // workers
  int64_t virtual_stages;
};

std::string name(const Case& c) {
  return gpipe::to_string(c.schedule) + " balance " + std::to_string(c.balance.size()) +
         " stages on " + std::to_string(c.devices) + " workers";
}

// The schedule x balance combinations over inplace_mlp's 6 layers.
std::vector<Case> cases() {
  return {
      {Schedule::GPipe, {2, 2, 2}, 3, 1},
      {Schedule::OneFOneB, {2, 2, 2}, 3, 1},
      {Schedule::OneFOneB, {1, 1, 1, 1, 1, 1}, 6, 1},
      {Schedule::ZBH1, {2, 2, 2}, 3, 1},
      {Schedule::ZBH1, {1, 1, 1, 1, 1, 1}, 6, 1},
      {Schedule::Interleaved1F1B, {1, 1, 1, 1, 1, 1}, 3, 2},
      {Schedule::Interleaved1F1B, {1, 1, 1, 1, 1, 1}, 2, 3},
      {Schedule::Interleaved1F1B, {2, 2, 2}, 3, 1},
      // ZB-V: two stages per worker in a V (worker 0: stages 0 and 3).
      {Schedule::ZBV, {2, 1, 1, 2}, 2, 2},
      {Schedule::ZBV, {1, 1, 1, 1, 1, 1}, 3, 2},
  };
}

gpipe::PipeOptions options_for(const Case& c, int64_t chunks, Checkpoint mode) {
  return gpipe::PipeOptions()
      .balance(c.balance)
      .devices(std::vector<c10::Device>(static_cast<size_t>(c.devices), torch::kCPU))
      .chunks(chunks)
      .checkpoint(mode)
      .schedule(c.schedule)
      .virtual_stages(c.virtual_stages);
}

}  // namespace

TEST_CASE("train_step: equals the plain model for every schedule, checkpoint mode and chunking",
          "[train_step]") {
  // rows, chunks: even, uneven (7 rows in 3 and in 5), fewer micro-batches
  // than stages, one micro-batch, more chunks than rows.
  const std::vector<std::pair<int64_t, int64_t>> cuts = {{8, 4}, {7, 3}, {7, 5}, {6, 2},
                                                         {5, 1}, {3, 8}, {12, 12}};
  for (const auto& c : cases()) {
    for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
      for (auto [rows, chunks] : cuts) {
        INFO(name(c) << ", checkpoint " << mode << ", " << rows << " rows, chunks " << chunks);
        auto model = inplace_mlp(3);
        auto ref = deep_copy(model);
        gpipe::Pipe pipe(model, options_for(c, chunks, mode));
        auto x = randn64({rows, 4});
        auto y = randn64({rows, 3});
        auto x_pipe = x.clone().requires_grad_(true);
        auto x_ref = x.clone().requires_grad_(true);

        auto loss = pipe->train_step(x_pipe, y, mse);
        auto want = torch::mse_loss(ref->forward(x_ref), y);
        want.backward();
        CHECK_FALSE(loss.requires_grad());
        CHECK(max_abs_diff(loss, want) <= kTolerance);
        check_param_grads(*pipe, *ref);
        CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);

        // A second step adds to .grad, as a second backward would.
        pipe->train_step(x_pipe, y, mse);
        torch::mse_loss(ref->forward(x_ref), y).backward();
        check_param_grads(*pipe, *ref);
      }
    }
  }
}

TEST_CASE("train_step: several inputs, outputs and targets", "[train_step]") {
  // Stage layers see (a, b) and return (a', b'): two Linear branches.
  struct PairImpl : torch::nn::Cloneable<PairImpl> {
    explicit PairImpl(int64_t seed) : seed_(seed) { reset(); }
    void reset() override {
      torch::manual_seed(static_cast<uint64_t>(seed_));
      a = register_module("a", torch::nn::Linear(3, 3));
      b = register_module("b", torch::nn::Linear(3, 3));
      to(torch::kFloat64);
    }
    std::vector<torch::Tensor> forward(std::vector<torch::Tensor> in) {
      return {torch::tanh(a(in[0]) + in[1]), b(in[1]) * in[0]};
    }
    torch::nn::Linear a{nullptr}, b{nullptr};
    int64_t seed_;
  };
  TORCH_MODULE(Pair);
  auto tuple_loss = [](const std::vector<torch::Tensor>& out, const std::vector<torch::Tensor>& t) {
    return torch::mse_loss(out[0], t[0]) + 0.5 * torch::mse_loss(out[1], t[1]);
  };
  for (auto schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZBH1}) {
    for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
      INFO("schedule " << schedule << ", checkpoint " << mode);
      torch::nn::Sequential model(Pair(1), Pair(2), Pair(3));
      auto ref = deep_copy(model);
      gpipe::Pipe pipe(model, gpipe::PipeOptions()
                                  .balance({1, 1, 1})
                                  .devices({torch::kCPU, torch::kCPU, torch::kCPU})
                                  .chunks(3)
                                  .checkpoint(mode)
                                  .schedule(schedule));
      auto a = randn64({7, 3}), b = randn64({7, 3});
      auto t0 = randn64({7, 3}), t1 = randn64({7, 3});
      auto loss = pipe->train_step_tuple({a, b}, {t0, t1}, tuple_loss);
      std::vector<torch::Tensor> h{a, b};
      for (auto& layer : *ref) h = layer.forward<std::vector<torch::Tensor>>(h);
      auto want = tuple_loss(h, {t0, t1});
      want.backward();
      CHECK(max_abs_diff(loss, want) <= kTolerance);
      check_param_grads(*pipe, *ref);
    }
  }
}

TEST_CASE("train_step: frozen layers get no grad, the others theirs", "[train_step]") {
  for (auto schedule : {Schedule::OneFOneB, Schedule::ZBH1}) {
    INFO("schedule " << schedule);
    auto model = inplace_mlp(5);
    auto ref = deep_copy(model);
    for (auto* m : {&model, &ref}) {
      for (auto& p : (*m)[0]->parameters()) p.requires_grad_(false);
      for (auto& p : (*m)[4]->parameters()) p.requires_grad_(false);
    }
    gpipe::Pipe pipe(model, gpipe::PipeOptions()
                                .balance({2, 2, 2})
                                .devices({torch::kCPU, torch::kCPU, torch::kCPU})
                                .chunks(4)
                                .schedule(schedule));
    auto x = randn64({8, 4}), y = randn64({8, 3});
    auto loss = pipe->train_step(x, y, mse);
    auto want = torch::mse_loss(ref->forward(x), y);
    want.backward();
    CHECK(max_abs_diff(loss, want) <= kTolerance);
    for (const auto& item : ref->named_parameters()) {
      INFO("parameter " << item.key());
      const auto got = pipe->named_parameters()[item.key()];
      CHECK(got.grad().defined() == item.value().grad().defined());
      CHECK(max_abs_diff(got.grad(), item.value().grad()) <= kTolerance);
    }
  }
}

TEST_CASE("train_step: a weight used at two depths of one stage is not counted twice",
          "[train_step]") {
  // y = W (W x): the weight joins the input path twice, so ZB-H1 cannot
  // split the cell and runs its whole backward in I.
  struct TwiceImpl : torch::nn::Cloneable<TwiceImpl> {
    TwiceImpl() { reset(); }
    void reset() override {
      torch::manual_seed(7);
      w = register_parameter("w", torch::randn({4, 4}, torch::kFloat64) * 0.5);
    }
    torch::Tensor forward(const torch::Tensor& x) { return torch::mm(torch::mm(x, w), w); }
    torch::Tensor w;
  };
  TORCH_MODULE(Twice);
  // And a weight shared by two matmuls through one transpose node.
  struct SharedTImpl : torch::nn::Cloneable<SharedTImpl> {
    SharedTImpl() { reset(); }
    void reset() override {
      torch::manual_seed(8);
      w = register_parameter("w", torch::randn({4, 4}, torch::kFloat64) * 0.5);
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto wt = w.t();
      return torch::mm(torch::tanh(torch::mm(x, wt)), wt) + x;
    }
    torch::Tensor w;
  };
  TORCH_MODULE(SharedT);
  for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
    INFO("checkpoint " << mode);
    torch::nn::Sequential model{Twice(), SharedT(), Twice(), SharedT()};
    auto ref = deep_copy(model);
    gpipe::Pipe pipe(model, gpipe::PipeOptions()
                                .balance({2, 2})
                                .devices({torch::kCPU, torch::kCPU})
                                .chunks(3)
                                .checkpoint(mode)
                                .schedule(Schedule::ZBH1));
    auto x = randn64({6, 4}).requires_grad_(true);
    auto x_ref = x.detach().clone().requires_grad_(true);
    auto y = randn64({6, 4});
    auto loss = pipe->train_step(x, y, mse);
    auto want = torch::mse_loss(ref->forward(x_ref), y);
    want.backward();
    CHECK(max_abs_diff(loss, want) <= kTolerance);
    check_param_grads(*pipe, *ref);
    CHECK(max_abs_diff(x.grad(), x_ref.grad()) <= kTolerance);
  }
}

TEST_CASE("train_step: bad targets and losses are clear errors", "[train_step]") {
  gpipe::Pipe pipe(inplace_mlp(), gpipe::PipeOptions()
                                      .balance({3, 3})
                                      .devices({torch::kCPU, torch::kCPU})
                                      .chunks(2));
  auto x = randn64({6, 4});
  CHECK_THROWS_WITH(pipe->train_step(x, randn64({5, 3}), mse),
                    Catch::Contains("target has 5 rows") && Catch::Contains("input has 6"));
  try {
    pipe->train_step(x, randn64({6, 3}),
                     [](const torch::Tensor& out, const torch::Tensor& t) { return out - t; });
    FAIL("a loss that is not one number was accepted");
  } catch (const gpipe::CellError& e) {
    CHECK(e.phase() == "loss");
    CHECK(e.stage() == 1);
    CHECK(std::string(e.what()).find("one number") != std::string::npos);
  }
  {
    torch::NoGradGuard no_grad;
    CHECK_THROWS_WITH(pipe->train_step(x, randn64({6, 3}), mse), Catch::Contains("grad mode"));
  }
  CHECK_THROWS_WITH(gpipe::Pipe(inplace_mlp(), gpipe::PipeOptions()
                                                   .balance({3, 3})
                                                   .devices({torch::kCPU})
                                                   .virtual_stages(2)),
                    Catch::Contains("virtual_stages is 2") && Catch::Contains("Interleaved1F1B"));
  CHECK_THROWS_WITH(gpipe::Pipe(inplace_mlp(), gpipe::PipeOptions()
                                                   .balance({1, 2, 3})
                                                   .devices({torch::kCPU})
                                                   .schedule(Schedule::Interleaved1F1B)
                                                   .virtual_stages(2)),
                    Catch::Contains("not a multiple of virtual_stages 2"));
}

namespace {

// x * w whose weight grad (only) throws where the plan says: under ZB-H1
// that is the W task, under a full backward the B task.
struct ScaleFn : torch::autograd::Function<ScaleFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, FaultPlan* plan, int64_t stage) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["plan"] = reinterpret_cast<int64_t>(plan);
    ctx->saved_data["stage"] = stage;
    ctx->saved_data["mb"] = marker_of(x);
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto* plan = reinterpret_cast<FaultPlan*>(ctx->saved_data["plan"].toInt());
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = grads[0] * saved[1];
    if (ctx->needs_input_grad(1)) {
      if (plan->hits(ctx->saved_data["stage"].toInt(), ctx->saved_data["mb"].toInt(),
                     FaultPhase::Backward)) {
        throw std::runtime_error("weight boom");
      }
      dw = (grads[0] * saved[0]).sum(0);
    }
    return {dx, dw, torch::Tensor(), torch::Tensor()};
  }
};

class ScaleImpl : public torch::nn::Cloneable<ScaleImpl> {
 public:
  ScaleImpl(int64_t stage, std::shared_ptr<FaultPlan> plan) : stage_(stage), plan_(std::move(plan)) {
    reset();
  }
  void reset() override { w = register_parameter("w", torch::full({6}, 0.9, torch::kFloat64)); }
  torch::Tensor forward(const torch::Tensor& x) {
    // Column 0 keeps the marker: scale the rest.
    auto scaled = ScaleFn::apply(x, w, plan_.get(), stage_);
    return torch::cat({x.narrow(1, 0, 1), scaled.narrow(1, 1, 5)}, 1);
  }
  torch::Tensor w;

 private:
  int64_t stage_;
  std::shared_ptr<FaultPlan> plan_;
};
TORCH_MODULE(Scale);

}  // namespace

TEST_CASE("train_step: a failure in F, B, I, W or the loss names its cell, and the next step works",
          "[train_step]") {
  auto plan = std::make_shared<FaultPlan>();         // the Throwers'
  auto weight_plan = std::make_shared<FaultPlan>();  // ScaleFn's weight grads
  const int64_t stages = 3, chunks = 4;
  auto build = [&](Schedule schedule, Checkpoint mode) {
    // faulty_model's stages with a Scale in the middle of each.
    torch::manual_seed(4);
    torch::nn::Sequential model;
    for (int64_t j = 0; j < stages; ++j) {
      model->push_back(MarkedLinear(5, 5));
      model->push_back(Scale(j, weight_plan));
      model->push_back(Thrower(j, plan));
    }
    return gpipe::Pipe(model, gpipe::PipeOptions()
                                  .balance({3, 3, 3})
                                  .devices({torch::kCPU, torch::kCPU, torch::kCPU})
                                  .chunks(chunks)
                                  .checkpoint(mode)
                                  .schedule(schedule));
  };
  auto x = marked_input(8, 6, chunks);
  auto y = randn64({8, 6});
  struct Fault {
    FaultPhase phase;
    bool in_loss;
  };
  for (auto schedule : {Schedule::OneFOneB, Schedule::ZBH1, Schedule::GPipe}) {
    for (auto mode : {Checkpoint::ExceptLast, Checkpoint::Never}) {
      auto pipe = build(schedule, mode);
      for (int64_t s = 0; s < stages; ++s) {
        for (int64_t mb : {int64_t{0}, chunks - 1}) {
          for (auto phase : {FaultPhase::Forward, FaultPhase::Backward, FaultPhase::Recompute}) {
            if (phase == FaultPhase::Recompute && (mode == Checkpoint::Never || mb == chunks - 1)) {
              continue;
            }
            INFO("schedule " << schedule << ", checkpoint " << mode << ", stage " << s
                             << ", micro-batch " << mb << ", " << phase_word(phase));
            plan->arm(s, mb, phase);
            std::string expected;
            if (phase == FaultPhase::Forward) {
              expected = "forward";
            } else if (phase == FaultPhase::Recompute) {
              expected = "recompute";
            } else if (schedule != Schedule::ZBH1) {
              expected = "backward";
            } else {
              // The Thrower's backward is on the input path: I (stage 0
              // passes no grad back, so all of its backward is W's).
              expected = s == 0 ? "weight-grad backward" : "input-grad backward";
            }
            try {
              within_deadline([&] { return pipe->train_step(x, y, mse); });
              FAIL("no error");
            } catch (const gpipe::CellError& e) {
              CHECK(e.stage() == s);
              CHECK(e.microbatch() == mb);
              CHECK(e.phase() == expected);
            }
            plan->disarm();
            zero_grads(*pipe);
            auto loss = within_deadline([&] { return pipe->train_step(x, y, mse); });
            CHECK(std::isfinite(loss.item<double>()));
          }
        }
      }
      // The loss.
      auto failing = [&](const torch::Tensor& out, const torch::Tensor& t) {
        if (marker_of(out) == 2) throw std::runtime_error("loss boom");
        return torch::mse_loss(out, t);
      };
      try {
        within_deadline([&] { return pipe->train_step(x, y, failing); });
        FAIL("no error");
      } catch (const gpipe::CellError& e) {
        CHECK(e.stage() == stages - 1);
        CHECK(e.microbatch() == 2);
        CHECK(e.phase() == "loss");
        CHECK(std::string(e.what()).find("loss boom") != std::string::npos);
      }
    }
  }
  // W itself: the weight grad of ScaleFn throws. Under ZB-H1 that is the W
  // task (I computes only input grads); under 1F1B the whole B.
  for (auto schedule : {Schedule::ZBH1, Schedule::OneFOneB}) {
    for (int64_t s = 0; s < stages; ++s) {
      auto pipe = build(schedule, Checkpoint::Never);
      INFO("schedule " << schedule << ", weight grad at stage " << s);
      weight_plan->arm(s, 1, FaultPhase::Backward);
      try {
        within_deadline([&] { return pipe->train_step(x, y, mse); });
        FAIL("no error");
      } catch (const gpipe::CellError& e) {
        CHECK(e.stage() == s);
        CHECK(e.microbatch() == 1);
        CHECK(e.phase() == (schedule == Schedule::ZBH1 ? "weight-grad backward" : "backward"));
        CHECK(std::string(e.what()).find("weight boom") != std::string::npos);
      }
      weight_plan->disarm();
      zero_grads(*pipe);
      auto loss = within_deadline([&] { return pipe->train_step(x, y, mse); });
      CHECK(std::isfinite(loss.item<double>()));
    }
  }
}

TEST_CASE("train_step: virtual stages also serve forward and loss.backward()", "[train_step]") {
  for (int64_t v : {2, 3}) {
    INFO("virtual_stages " << v);
    auto model = inplace_mlp(9);
    auto ref = deep_copy(model);
    const int64_t workers = 6 / v;
    gpipe::Pipe pipe(model, gpipe::PipeOptions()
                                .balance({1, 1, 1, 1, 1, 1})
                                .devices(std::vector<c10::Device>(static_cast<size_t>(workers),
                                                                  torch::kCPU))
                                .chunks(4)
                                .schedule(Schedule::Interleaved1F1B)
                                .virtual_stages(v));
    CHECK(pipe->devices().size() == static_cast<size_t>(workers));
    auto x = randn64({7, 4}).requires_grad_(true);
    auto x_ref = x.detach().clone().requires_grad_(true);
    auto out = pipe->forward(x);
    auto want = ref->forward(x_ref);
    CHECK(max_abs_diff(out, want) <= kTolerance);
    out.pow(2).sum().backward();
    want.pow(2).sum().backward();
    check_param_grads(*pipe, *ref);
    CHECK(max_abs_diff(x.grad(), x_ref.grad()) <= kTolerance);
  }
}

namespace {

// A layer whose forward runs another Pipe's train_step: refused at once.
class NestedStepImpl : public torch::nn::Cloneable<NestedStepImpl> {
 public:
  explicit NestedStepImpl(gpipe::Pipe inner) : inner_(std::move(inner)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    inner_->train_step(x, x, mse);
    return x;
  }

 private:
  gpipe::Pipe inner_;
};
TORCH_MODULE(NestedStep);

}  // namespace

TEST_CASE("train_step: a train_step inside another Pipe's layer is refused at once",
          "[train_step]") {
  gpipe::Pipe inner(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4)),
                    gpipe::PipeOptions().balance({1, 1}).devices({torch::kCPU, torch::kCPU}).chunks(2));
  gpipe::Pipe outer(torch::nn::Sequential(torch::nn::Linear(4, 4), NestedStep(inner)),
                    gpipe::PipeOptions().balance({1, 1}).devices({torch::kCPU, torch::kCPU}).chunks(2));
  auto x = torch::randn({4, 4});
  within_deadline([&] {
    CHECK_THROWS_WITH(outer->train_step(x, x, mse), Catch::Contains("inside a layer of a Pipe"));
    CHECK_THROWS_WITH(outer->forward(x), Catch::Contains("inside a layer of a Pipe"));
    return 0;
  });
  // Both still work on their own.
  within_deadline([&] { return inner->train_step(x, x, mse); });
}

TEST_CASE("train_step: a schedule given as a CSV table runs as the plain model, both ways",
          "[train_step]") {
  // A zero-bubble table for 3 devices, 4 micro-batches: B split into I
  // and W, written as torch.distributed.pipelining writes its schedules.
  const std::string table =
      "0F0,0F1,0F2,,0I0,0F3,0I1,0W0,0I2,0W1,0I3,0W2,0W3\n"
      "1F0,1F1,1I0,1F2,1I1,1F3,1I2,1W0,1I3,1W1,1W2,1W3\n"
      "2F0,2I0,2F1,2I1,2F2,2I2,2F3,2I3,2W0,2W1,2W2,2W3\n";
  for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
    INFO("checkpoint " << mode);
    auto model = inplace_mlp(3);
    auto ref = deep_copy(model);
    gpipe::Pipe pipe(model, options_for({Schedule::OneFOneB, {2, 2, 2}, 3, 1}, 4, mode)
                                .schedule_csv(table));
    CHECK(pipe->schedule_csv() ==
          "0F0,0F1,0F2,0I0,0F3,0I1,0W0,0I2,0W1,0I3,0W2,0W3\n"
          "1F0,1F1,1I0,1F2,1I1,1F3,1I2,1W0,1I3,1W1,1W2,1W3\n"
          "2F0,2I0,2F1,2I1,2F2,2I2,2F3,2I3,2W0,2W1,2W2,2W3\n");
    auto x = randn64({8, 4});
    auto y = randn64({8, 3});
    auto loss = pipe->train_step(x, y, mse);
    auto want = torch::mse_loss(ref->forward(x), y);
    want.backward();
    CHECK(max_abs_diff(loss, want) <= kTolerance);
    check_param_grads(*pipe, *ref);
  }
  // The built-in interleaved plan, exported and loaded back, fixes
  // virtual_stages itself.
  gpipe::Pipe interleaved(inplace_mlp(3),
                          options_for({Schedule::Interleaved1F1B, {1, 1, 1, 1, 1, 1}, 3, 2}, 5,
                                      Checkpoint::ExceptLast));
  gpipe::Pipe loaded(inplace_mlp(3),
                     options_for({Schedule::GPipe, {1, 1, 1, 1, 1, 1}, 3, 1}, 5,
                                 Checkpoint::ExceptLast)
                         .schedule_csv(interleaved->schedule_csv()));
  CHECK(loaded->options().virtual_stages() == 2);
  CHECK(loaded->schedule_csv() == interleaved->schedule_csv());
  // Tables that do not fit, or are not tables.
  auto with = [&](const std::string& csv, int64_t chunks) {
    gpipe::Pipe p(inplace_mlp(3), options_for({Schedule::OneFOneB, {2, 2, 2}, 3, 1}, chunks,
                                               Checkpoint::Never)
                                      .schedule_csv(csv));
  };
  CHECK_THROWS_WITH(with(table, 5), Catch::Contains("the schedule runs 4 micro-batches but chunks "
                                                    "is 5; pass chunks=4"));
  CHECK_THROWS_WITH(with("0F0,0B0\n1F0,1B0\n", 1),
                    Catch::Contains("the schedule has 2 rows but the pipe runs on 3 devices"));
  CHECK_THROWS_WITH(with("0F0,0B0,0Z0\n", 1), Catch::Contains("('0Z0') is not an action"));
  CHECK_THROWS_AS(with("0F0,0B0,0Z0\n", 1), c10::ValueError);
}

TEST_CASE("train_step: a checkpoint mode per stage", "[train_step]") {
  // Issue 26 item 3: {Always, ExceptLast, Never} over 3 stages, 4
  // micro-batches: stage 0 checkpoints 4, stage 1 3, stage 2 none; the
  // drop-in forward and train_step both, with the plain model's grads.
  const std::vector<Checkpoint> modes{Checkpoint::Always, Checkpoint::ExceptLast,
                                      Checkpoint::Never};
  for (auto schedule : {Schedule::OneFOneB, Schedule::ZBH1}) {
    INFO(schedule);
    auto log = std::make_shared<ProbeLog>();
    torch::nn::Sequential model;
    for (int64_t j = 0; j < 3; ++j) {
      model->push_back(Probe(j, log));
      model->push_back(MarkedLinear(5, 5));
    }
    auto ref = deep_copy(model);
    gpipe::Pipe pipe(model, gpipe::PipeOptions()
                                .balance({2, 2, 2})
                                .devices(std::vector<c10::Device>(3, torch::kCPU))
                                .chunks(4)
                                .schedule(schedule)
                                .stage_checkpoints(modes));
    const auto x = marked_input(8, 6, 4);
    const auto y = randn64({8, 6});
    auto loss = pipe->train_step(x, y, mse);
    auto want = torch::mse_loss(ref->forward(x), y);
    want.backward();
    CHECK(max_abs_diff(loss, want) <= kTolerance);
    check_param_grads(*pipe, *ref);
    std::vector<int64_t> checkpointed(3, 0);
    for (const auto& r : log->take()) checkpointed[static_cast<size_t>(r.stage)] += r.checkpointing;
    CHECK(checkpointed == std::vector<int64_t>{4, 3, 0});
  }
  CHECK_THROWS_WITH(
      gpipe::Pipe(inplace_mlp(3), gpipe::PipeOptions().balance({2, 2, 2}).chunks(2).stage_checkpoints(
                                      {Checkpoint::Never, Checkpoint::Never})),
      Catch::Contains("checkpoint has 2 modes for 3 stages; give one mode, or one per stage"));
}

TEST_CASE("train_step: zb_v places its stages in a V, virtual_stages 2 implied", "[train_step]") {
  auto model = inplace_mlp(3);
  auto ref = deep_copy(model);
  // virtual_stages left at 1: zb_v takes 2; worker w runs stages w and 2W-1-w.
  gpipe::Pipe pipe(model, gpipe::PipeOptions()
                              .balance({2, 1, 1, 2})
                              .devices({torch::kCPU, torch::kCPU})
                              .chunks(4)
                              .schedule(Schedule::ZBV));
  CHECK(pipe->options().virtual_stages() == 2);
  const std::string csv = pipe->schedule_csv();
  const auto row0 = csv.substr(0, csv.find('\n'));
  CHECK(row0.find("0F0") != std::string::npos);
  CHECK(row0.find("3F0") != std::string::npos);  // the last stage: on worker 0
  CHECK(row0.find("1F0") == std::string::npos);
  auto x = randn64({8, 4});
  auto y = randn64({8, 3});
  auto loss = pipe->train_step(x, y, mse);
  auto want = torch::mse_loss(ref->forward(x), y);
  want.backward();
  CHECK(max_abs_diff(loss, want) <= kTolerance);
  check_param_grads(*pipe, *ref);
  CHECK_THROWS_WITH(gpipe::Pipe(inplace_mlp(3), gpipe::PipeOptions()
                                                    .balance({1, 1, 1, 1, 1, 1})
                                                    .devices({torch::kCPU, torch::kCPU})
                                                    .schedule(Schedule::ZBV)
                                                    .virtual_stages(3)),
                    Catch::Matchers::Contains("schedule zb_v runs two stages per device"));
  // A table given too replaces the named schedule: its loop placement, one stage per device.
  auto tabled = inplace_mlp(3);
  auto tabled_ref = deep_copy(tabled);
  gpipe::Pipe from_table(tabled, gpipe::PipeOptions()
                                     .balance({3, 3})
                                     .devices({torch::kCPU, torch::kCPU})
                                     .chunks(2)
                                     .schedule(Schedule::ZBV)
                                     .schedule_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"));
  CHECK(from_table->options().virtual_stages() == 1);
  auto table_loss = from_table->train_step(x, y, mse);
  torch::mse_loss(tabled_ref->forward(x), y).backward();
  check_param_grads(*from_table, *tabled_ref);
  CHECK(table_loss.defined());
  // A table placing its stages in a V (the named zb_v's, exported) runs in the V: the
  // stages on the V's devices, the same loss and grads as the plain model.
  auto v_model = inplace_mlp(3);
  auto v_ref = deep_copy(v_model);
  gpipe::Pipe v_table(v_model, gpipe::PipeOptions()
                                   .balance({2, 1, 1, 2})
                                   .devices({torch::kCPU, torch::kCPU})
                                   .chunks(4)
                                   .schedule_csv(csv));
  CHECK(v_table->options().virtual_stages() == 2);
  CHECK(v_table->schedule_csv() == csv);
  auto v_loss = v_table->train_step(x, y, mse);
  auto v_want = torch::mse_loss(v_ref->forward(x), y);
  v_want.backward();
  CHECK(max_abs_diff(v_loss, v_want) <= kTolerance);
  check_param_grads(*v_table, *v_ref);
}
