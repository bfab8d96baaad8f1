// test_skip.cpp — skip connections: Pipe == Sequential with skips across 0, 1, 2 and K-1 stages, every mode and schedule; bad pairings.
#include "models.h"

#include <string>

using namespace gpipe_test;

namespace {

using gpipe::Checkpoint;
using gpipe::Schedule;

constexpr int64_t kWidth = 6;

/// tanh(Linear(x)); stashes its input under each of `names`.
class StashImpl : public torch::nn::Cloneable<StashImpl>, public gpipe::Skippable {
 public:
  explicit StashImpl(std::vector<std::string> names)
      : gpipe::Skippable({.stash = names}), names_(std::move(names)) {
    reset();
  }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    linear->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    for (size_t k = 0; k < names_.size(); ++k) stash(names_[k], k == 0 ? x : x * (1.0 + k));
    return torch::tanh(linear(x));
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::vector<std::string> names_;
};
TORCH_MODULE(Stash);

/// tanh(Linear(x)) plus what each of `names` carried (scaled apart).
class PopImpl : public torch::nn::Cloneable<PopImpl>, public gpipe::Skippable {
 public:
  explicit PopImpl(std::vector<std::string> names)
      : gpipe::Skippable({.pop = names}), names_(std::move(names)) {
    reset();
  }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    linear->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::tanh(linear(x));
    for (size_t k = 0; k < names_.size(); ++k) y = y + pop(names_[k]) * (0.5 + k);
    return y;
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::vector<std::string> names_;
};
TORCH_MODULE(Pop);

/// tanh(Linear(x)), no skips.
class PlainImpl : public torch::nn::Cloneable<PlainImpl> {
 public:
  PlainImpl() { reset(); }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    linear->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(linear(x)); }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Plain);

Plain plain_layer() { return Plain(); }

struct Model {
  std::string name;
  torch::nn::Sequential sequential;
};

// Six layers each; comments mark where each skip goes under {2,2,2} and
// {1,1,1,1,1,1}.
std::vector<Model> models() {
  torch::manual_seed(11);
  std::vector<Model> out;
  // 0 -> 3: across 1 stage of {2,2,2}, 3 of {1,...}.
  out.push_back({"residual 0->3",
                 torch::nn::Sequential{Stash(std::vector<std::string>{"r"}), plain_layer(),
                                       plain_layer(), Pop(std::vector<std::string>{"r"}),
                                       plain_layer(), plain_layer()}});
  // 0 -> 5: across 2 stages of {2,2,2}, K-1 = 5 of {1,...}.
  out.push_back({"residual 0->5",
                 torch::nn::Sequential{Stash(std::vector<std::string>{"r"}), plain_layer(),
                                       plain_layer(), plain_layer(), plain_layer(),
                                       Pop(std::vector<std::string>{"r"})}});
  // U-Net: nested skips 0 -> 4 and 1 -> 3, 1 -> 2 (two leave layer 1).
  out.push_back({"unet", torch::nn::Sequential{Stash(std::vector<std::string>{"d1"}),
                                               Stash(std::vector<std::string>{"d2", "d3"}),
                                               Pop(std::vector<std::string>{"d3"}),
                                               Pop(std::vector<std::string>{"d2"}),
                                               Pop(std::vector<std::string>{"d1"}),
                                               plain_layer()}});
  // The same name twice, kept apart by namespaces: 2 -> 3 and 4 -> 5, each
  // within a stage of {2,2,2}, across of {3,3} (2 -> 3) and {1,...}.
  {
    gpipe::Namespace a, b;
    Stash s1(std::vector<std::string>{"s"});
    Pop p1(std::vector<std::string>{"s"});
    Stash s2(std::vector<std::string>{"s"});
    Pop p2(std::vector<std::string>{"s"});
    s1->isolate(a);
    p1->isolate(a);
    s2->isolate(b);
    p2->isolate(b);
    out.push_back({"namespaces", torch::nn::Sequential{plain_layer(), plain_layer(), s1, p1, s2, p2}});
  }
  return out;
}

void check_forward_backward(const Model& model, const std::vector<int64_t>& balance,
                            int64_t chunks, Checkpoint mode) {
  auto ref = deep_copy(model.sequential);
  auto copy = deep_copy(model.sequential);
  gpipe::Pipe pipe(copy, gpipe::PipeOptions()
                             .balance(balance)
                             .devices(std::vector<c10::Device>(balance.size(), torch::kCPU))
                             .chunks(chunks)
                             .checkpoint(mode));
  auto x = randn64({7, kWidth});
  auto x_pipe = x.clone().requires_grad_(true);
  auto x_ref = x.clone().requires_grad_(true);
  auto y_pipe = pipe->forward(x_pipe);
  auto y_ref = ref->forward(x_ref);
  CHECK(max_abs_diff(y_pipe, y_ref) <= kTolerance);
  auto g = randn64({7, kWidth});
  y_pipe.backward(g);
  y_ref.backward(g);
  CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
  check_param_grads(*pipe, *ref);
  // Nothing stayed behind in this thread's tracker.
  CHECK(gpipe::current_skip_tracker().size() == 0);
}

}  // namespace

TEST_CASE("skip: the plain Sequential runs skippable layers through the thread's tracker",
          "[skip]") {
  for (auto model : models()) {
    INFO(model.name);
    auto y = model.sequential->forward(randn64({3, kWidth}));
    CHECK(y.sizes() == std::vector<int64_t>{3, kWidth});
    CHECK(gpipe::current_skip_tracker().size() == 0);
  }
}

TEST_CASE("skip: Pipe equals Sequential with skips across 0, 1, 2 and K-1 stages", "[skip]") {
  const std::vector<std::vector<int64_t>> balances = {{6}, {2, 2, 2}, {1, 1, 1, 1, 1, 1}, {3, 3},
                                                      {1, 4, 1}};
  for (const auto& model : models()) {
    for (const auto& balance : balances) {
      for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
        for (int64_t chunks : {1, 3}) {
          INFO(model.name << ", " << balance.size() << " stages, checkpoint " << mode
                          << ", chunks " << chunks);
          check_forward_backward(model, balance, chunks, mode);
        }
      }
    }
  }
}

TEST_CASE("skip: train_step equals the plain model for every schedule", "[skip][train_step]") {
  struct Case {
    Schedule schedule;
    std::vector<int64_t> balance;
    int64_t devices;
    int64_t virtual_stages;
  };
  const std::vector<Case> cases = {
      {Schedule::GPipe, {2, 2, 2}, 3, 1},
      {Schedule::OneFOneB, {1, 1, 1, 1, 1, 1}, 6, 1},
      {Schedule::ZBH1, {2, 2, 2}, 3, 1},
      {Schedule::ZBH1, {1, 1, 1, 1, 1, 1}, 6, 1},
      {Schedule::Interleaved1F1B, {1, 1, 1, 1, 1, 1}, 3, 2},
      {Schedule::Interleaved1F1B, {1, 1, 1, 1, 1, 1}, 2, 3},
  };
  for (const auto& model : models()) {
    for (const auto& c : cases) {
      for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
        INFO(model.name << ", " << gpipe::to_string(c.schedule) << ", " << c.balance.size()
                        << " stages on " << c.devices << " workers, checkpoint " << mode);
        auto ref = deep_copy(model.sequential);
        auto copy = deep_copy(model.sequential);
        gpipe::Pipe pipe(copy,
                         gpipe::PipeOptions()
                             .balance(c.balance)
                             .devices(std::vector<c10::Device>(static_cast<size_t>(c.devices),
                                                               torch::kCPU))
                             .chunks(4)
                             .checkpoint(mode)
                             .schedule(c.schedule)
                             .virtual_stages(c.virtual_stages));
        auto x = randn64({8, kWidth});
        auto target = randn64({8, kWidth});
        auto x_pipe = x.clone().requires_grad_(true);
        auto x_ref = x.clone().requires_grad_(true);
        auto loss = pipe->train_step(x_pipe, target, [](const auto& out, const auto& t) {
          return torch::mse_loss(out, t);
        });
        auto want = torch::mse_loss(ref->forward(x_ref), target);
        want.backward();
        CHECK(max_abs_diff(loss, want) <= kTolerance);
        CHECK(max_abs_diff(x_pipe.grad(), x_ref.grad()) <= kTolerance);
        check_param_grads(*pipe, *ref);
      }
    }
  }
}

TEST_CASE("skip: a frozen stashing stage fed an input without grad owes no grad", "[skip]") {
  // Stage 0 needs no grad at all: its cells skip their backward, the skip's
  // route to stage 2 carries none back; everything else must match.
  auto model = models()[1].sequential;
  auto ref = deep_copy(model);
  for (const auto& m : {model, ref}) {
    for (auto& p : m->ptr(0)->parameters()) p.requires_grad_(false);
    for (auto& p : m->ptr(1)->parameters()) p.requires_grad_(false);
  }
  gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({2, 2, 2}).devices(
                              std::vector<c10::Device>(3, torch::kCPU)).chunks(2));
  auto x = randn64({4, kWidth});
  auto y_pipe = pipe->forward(x);
  auto y_ref = ref->forward(x);
  CHECK(max_abs_diff(y_pipe, y_ref) <= kTolerance);
  y_pipe.sum().backward();
  y_ref.sum().backward();
  for (const auto& item : ref->named_parameters()) {
    INFO(item.key());
    const auto& got = pipe->named_parameters()[item.key()].grad();
    CHECK(got.defined() == item.value().grad().defined());
    CHECK(max_abs_diff(got, item.value().grad()) <= kTolerance);
  }
}

TEST_CASE("skip: pairing mistakes are refused when the Pipe is built, naming layer and skip",
          "[skip]") {
  using Names = std::vector<std::string>;
  auto refused = [](torch::nn::Sequential model, const std::vector<std::string>& parts) {
    try {
      gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({1, static_cast<int64_t>(model->size()) - 1})
                                  .devices(std::vector<c10::Device>(2, torch::kCPU)));
      FAIL("the Pipe was built");
    } catch (const c10::ValueError& e) {
      const std::string what = e.what();
      INFO(what);
      for (const auto& p : parts) CHECK(what.find(p) != std::string::npos);
    }
  };
  // Pop without a stash before it.
  refused(torch::nn::Sequential{plain_layer(), Pop(Names{"x"})},
          {"layer 1 (PopImpl) pops 'x'", "no layer before it stashes it"});
  // A stash nobody pops.
  refused(torch::nn::Sequential{Stash(Names{"x"}), plain_layer()},
          {"layer 0 (StashImpl) stashes 'x'", "no later layer pops it"});
  // One name stashed twice without namespaces.
  refused(torch::nn::Sequential{Stash(Names{"x"}), Stash(Names{"x"}), Pop(Names{"x"})},
          {"layer 1 (StashImpl) stashes 'x'", "layer 0 (StashImpl) stashes already",
           "gpipe::Namespace"});
  // verify_skippables on its own says the same.
  torch::nn::Sequential lonely{Stash(Names{"y"}), plain_layer()};
  CHECK_THROWS_WITH(gpipe::verify_skippables(lonely),
                    Catch::Contains("layer 0 (StashImpl) stashes 'y'"));
}

TEST_CASE("skip: a layer that breaks its declaration fails with its name and the skip's",
          "[skip]") {
  // Declares "x" but stashes nothing.
  struct SilentImpl : torch::nn::Cloneable<SilentImpl>, gpipe::Skippable {
    SilentImpl() : gpipe::Skippable({.stash = {"x"}}) {}
    void reset() override {}
    torch::Tensor forward(const torch::Tensor& x) { return x * 2; }
  };
  struct LoudImpl : torch::nn::Cloneable<LoudImpl>, gpipe::Skippable {
    LoudImpl() : gpipe::Skippable({.pop = {"x"}}) {}
    void reset() override {}
    torch::Tensor forward(const torch::Tensor& x) { return x + pop("x"); }
  };
  // Stashes a name it does not declare.
  struct SneakyImpl : torch::nn::Cloneable<SneakyImpl>, gpipe::Skippable {
    SneakyImpl() : gpipe::Skippable({.stash = {"x"}}) {}
    void reset() override {}
    torch::Tensor forward(const torch::Tensor& x) {
      stash("x", x);
      stash("z", x);
      return x;
    }
  };
  {
    torch::nn::Sequential model{torch::nn::AnyModule(std::make_shared<SilentImpl>()),
                                torch::nn::AnyModule(std::make_shared<LoudImpl>())};
    gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({1, 1}).devices(
                                std::vector<c10::Device>(2, torch::kCPU)));
    CHECK_THROWS_WITH(pipe->forward(randn64({2, 3})),
                      Catch::Contains("layer 0 (SilentImpl) declares that it stashes 'x' but its "
                                      "forward did not stash it"));
  }
  {
    torch::nn::Sequential model{torch::nn::AnyModule(std::make_shared<SneakyImpl>()),
                                torch::nn::AnyModule(std::make_shared<LoudImpl>())};
    gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({1, 1}).devices(
                                std::vector<c10::Device>(2, torch::kCPU)));
    CHECK_THROWS_WITH(pipe->forward(randn64({2, 3})),
                      Catch::Contains("layer SneakyImpl stashed 'z' but does not declare it"));
  }
}

TEST_CASE("skip: balance_by_time and balance_by_size profile skippable layers", "[skip][balance]") {
  for (auto model : models()) {
    INFO(model.name);
    auto sample = randn64({4, kWidth});
    auto by_time = gpipe::balance_by_time(3, model.sequential, sample,
                                          gpipe::BalanceOptions().timeout(0.01));
    auto by_size = gpipe::balance_by_size(3, model.sequential, sample);
    CHECK(gpipe::current_skip_tracker().size() == 0);
    for (const auto& balance : {by_time, by_size}) {
      REQUIRE(balance.size() == 3);
      check_forward_backward(model, balance, 2, Checkpoint::ExceptLast);
    }
  }
}
