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

using gpipe_test::SharedWeight;

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

TEST_CASE("options: a V placement with more devices than it uses is refused", "[options]") {
  using namespace torch::nn;
  auto eight = [] {
    Sequential model;
    for (int i = 0; i < 8; ++i) model->push_back(Linear(3, 3));
    return model;
  };
  const std::vector<c10::Device> cpus(8, c10::Device(c10::kCPU));
  // zb_v: 8 stages in a V on 4 devices; 8 were given.
  CHECK_THROWS_WITH(
      make(eight(), PipeOptions().balance({1, 1, 1, 1, 1, 1, 1, 1}).devices(cpus)
                        .schedule(gpipe::Schedule::ZBV)),
      Contains("zb_v") && Contains("4 devices") && Contains("8 devices") &&
          Contains("16 entries"));
  // 2 entries and 2 devices: both stages would share one device.
  CHECK_THROWS_WITH(
      make(eight(), PipeOptions().balance({4, 4}).devices({c10::kCPU, c10::kCPU})
                        .schedule(gpipe::Schedule::ZBV)),
      Contains("1 device") && Contains("2 devices"));
  // Interleaved, virtual_stages 2: 4 entries on 2 devices, 3 given.
  CHECK_THROWS_WITH(
      make(eight(), PipeOptions().balance({2, 2, 2, 2}).virtual_stages(2)
                        .devices({c10::kCPU, c10::kCPU, c10::kCPU})
                        .schedule(gpipe::Schedule::Interleaved1F1B)),
      Contains("2 devices") && Contains("3 devices"));
  // Exactly the devices it uses: fine; and one stage per device keeps torchgpipe's rule (extra
  // devices are left unused).
  CHECK_NOTHROW(make(eight(), PipeOptions().balance({1, 1, 1, 1, 1, 1, 1, 1})
                                  .devices(std::vector<c10::Device>(4, c10::kCPU))
                                  .schedule(gpipe::Schedule::ZBV)));
  CHECK(make(eight(), PipeOptions().balance({4, 4}).devices(cpus))->devices().size() == 2);
  // A computed balance fills every device given: 8 layers over 4 devices in a V.
  CHECK(make(eight(), PipeOptions().devices(std::vector<c10::Device>(4, c10::kCPU))
                          .schedule(gpipe::Schedule::ZBV))->balance().size() == 8);
  // Too few layers to fill 8 devices in a V (16 stages): refused, naming what to pass.
  CHECK_THROWS_WITH(make(eight(), PipeOptions().devices(cpus).schedule(gpipe::Schedule::ZBV)),
                    Contains("8 layers") && Contains("8 devices") && Contains("4 devices"));
}
