// test_pipe_options.cpp — bad arguments fail at construction (or at the call) with a message naming the values.
#include "models.h"

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <sstream>
#include <vector>

using Catch::Contains;
using gpipe::Checkpoint;
using gpipe::PipeOptions;

namespace {

torch::nn::Sequential three_layers() {
  using namespace torch::nn;
  return Sequential(Linear(3, 4), ReLU(), Linear(4, 2));
}

gpipe::Pipe make(torch::nn::Sequential model, PipeOptions options) {
  return gpipe::Pipe(std::move(model), std::move(options));
}

}  // namespace

TEST_CASE("options: defaults and printing", "[options]") {
  const PipeOptions options;
  CHECK(options.balance().empty());
  CHECK(options.devices().empty());
  CHECK(options.chunks() == 1);
  CHECK(options.checkpoint() == Checkpoint::ExceptLast);
  CHECK(gpipe::to_string(Checkpoint::Always) == "always");
  CHECK(gpipe::to_string(Checkpoint::ExceptLast) == "except_last");
  CHECK(gpipe::to_string(Checkpoint::Never) == "never");
  std::ostringstream s;
  s << Checkpoint::Never;
  CHECK(s.str() == "never");
}

TEST_CASE("options: an empty Sequential is refused", "[options]") {
  REQUIRE_THROWS_AS(make(torch::nn::Sequential(), PipeOptions().balance({1})), c10::Error);
  CHECK_THROWS_WITH(make(torch::nn::Sequential(), PipeOptions().balance({1})),
                    Contains("no layers"));
  CHECK_THROWS_WITH(make(torch::nn::Sequential(nullptr), PipeOptions().balance({1})),
                    Contains("empty holder"));
}

TEST_CASE("options: a balance entry below 1 is refused", "[options]") {
  REQUIRE_THROWS_AS(make(three_layers(), PipeOptions().balance({2, 0, 1})), c10::Error);
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions().balance({2, 0, 1})),
                    Contains("{2, 0, 1}") && Contains("stage 1 0 layers"));
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions().balance({4, -1})),
                    Contains("{4, -1}") && Contains("-1"));
}

TEST_CASE("options: a balance not summing to the layers is refused", "[options]") {
  REQUIRE_THROWS_AS(make(three_layers(), PipeOptions().balance({1, 1})), c10::Error);
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions().balance({1, 1})),
                    Contains("sums to 2") && Contains("3 layers"));
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions().balance({2, 2, 1})),
                    Contains("sums to 5") && Contains("3 layers"));
}

TEST_CASE("options: fewer devices than stages is refused", "[options]") {
  const std::vector<c10::Device> two(2, c10::Device(c10::kCPU));
  REQUIRE_THROWS_AS(make(three_layers(), PipeOptions().balance({1, 1, 1}).devices(two)),
                    c10::Error);
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions().balance({1, 1, 1}).devices(two)),
                    Contains("3 stages") && Contains("2 devices"));
}

TEST_CASE("options: chunks below 1 are refused", "[options]") {
  const auto chunks = GENERATE(as<int64_t>{}, 0, -2);
  CAPTURE(chunks);
  REQUIRE_THROWS_AS(make(three_layers(), PipeOptions().balance({3}).chunks(chunks)), c10::Error);
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions().balance({3}).chunks(chunks)),
                    Contains("chunks") && Contains("got " + std::to_string(chunks)));
}

TEST_CASE("options: the same module object twice is refused", "[options]") {
  torch::nn::Linear shared(3, 3);
  torch::nn::Sequential model(shared, torch::nn::ReLU(), shared);
  REQUIRE_THROWS_AS(make(model, PipeOptions().balance({1, 1, 1})), c10::Error);
  CHECK_THROWS_WITH(make(model, PipeOptions().balance({1, 1, 1})),
                    Contains("layer 2") && Contains("layer 0") && Contains("same module"));
}

TEST_CASE("options: an empty balance without devices is refused", "[options]") {
  if (torch::cuda::is_available()) {
    // With CUDA the stages are counted by the visible GPUs instead.
    SUCCEED("CUDA available: an empty balance is computed");
    return;
  }
  REQUIRE_THROWS_AS(make(three_layers(), PipeOptions()), c10::Error);
  CHECK_THROWS_WITH(make(three_layers(), PipeOptions()),
                    Contains("balance is empty") && Contains("devices"));
}

TEST_CASE("options: a valid construction does not throw", "[options]") {
  // The negative tests above must not pass because everything throws.
  CHECK_NOTHROW(make(three_layers(), PipeOptions().balance({1, 1, 1}).chunks(2)));
  CHECK_NOTHROW(make(three_layers(), PipeOptions().balance({2, 1}).devices(
                                         std::vector<c10::Device>(3, c10::Device(c10::kCPU)))));
}

TEST_CASE("options: bad inputs at forward name the problem", "[options]") {
  gpipe::Pipe pipe(three_layers(), PipeOptions().balance({2, 1}).chunks(2));
  CHECK_THROWS_WITH(pipe->forward(torch::tensor(1.0f)), Contains("0-dimensional"));
  CHECK_THROWS_WITH(pipe->forward_tuple(std::vector<torch::Tensor>{}), Contains("no input"));
  // The Pipe still works afterwards.
  CHECK(pipe->forward(torch::randn({4, 3})).sizes() == torch::IntArrayRef({4, 2}));
}

namespace {

/// x @ weight, with `weight` given: two of these share one parameter.
class SharedWeightImpl : public torch::nn::Cloneable<SharedWeightImpl> {
 public:
  explicit SharedWeightImpl(torch::Tensor w) : w_(std::move(w)) { reset(); }
  void reset() override { weight = register_parameter("weight", w_); }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight); }
  torch::Tensor weight;

 private:
  torch::Tensor w_;
};
TORCH_MODULE(SharedWeight);

}  // namespace

TEST_CASE("options: a weight shared by layers on two devices is refused before anything moves",
          "[options]") {
  auto w = torch::randn({3, 3}, torch::kFloat64).requires_grad_(true);
  torch::nn::Sequential model{SharedWeight(w), torch::nn::Tanh(), SharedWeight(w)};
  CHECK_THROWS_WITH(
      gpipe::Pipe(model, gpipe::PipeOptions()
                             .balance({2, 1})
                             .devices({torch::kCPU, c10::Device(c10::kMeta)})),
      Catch::Contains("parameter '2.weight' of layer 2 (on meta)") &&
          Catch::Contains("same tensor as '0.weight' of layer 0 (on cpu)") &&
          Catch::Contains("put those layers on one device, or untie the weights"));
  CHECK(w.device().is_cpu());
  CHECK(model[2]->parameters()[0].device().is_cpu());

  // On one device the tie is fine: the grad is the sum of both uses.
  auto ref = torch::nn::Sequential(SharedWeight(w), torch::nn::Tanh(), SharedWeight(w));
  gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({2, 1}).devices({torch::kCPU, torch::kCPU}).chunks(2));
  auto x = torch::randn({4, 3}, torch::kFloat64);
  pipe->forward(x).sum().backward();
  auto got = w.grad().clone();
  w.mutable_grad().reset();
  ref->forward(x).sum().backward();
  CHECK(gpipe_test::max_abs_diff(got, w.grad()) <= gpipe_test::kTolerance);
}
