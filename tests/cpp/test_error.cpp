// test_error.cpp — a bad argument's what() is its message alone (no C++ backtrace), typed as c10's Value/IndexError.
#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

using Catch::Contains;
using gpipe::PipeOptions;

namespace {

torch::nn::Sequential layers(int64_t n) {
  torch::nn::Sequential model;
  for (int64_t i = 0; i < n; ++i) model->push_back(torch::nn::Linear(2, 2));
  return model;
}

// What a c10::Error of type E thrown by `f` says; fails the test when `f`
// throws nothing or something else.
template <typename E, typename F>
std::string what_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("threw another type: " << e.what());
  }
  FAIL("threw nothing");
  return "";
}

// The marks of a C++ backtrace in c10::Error::what(): the source location
// line and the frames.
bool has_backtrace(const std::string& what) {
  return what.find("Exception raised from") != std::string::npos ||
         what.find("frame #") != std::string::npos;
}

}  // namespace

TEST_CASE("error: TORCH_CHECK's what() carries a backtrace (what the checks below must not)", "[error]") {
  // The control: proves has_backtrace recognises torch's format, so the
  // checks below can fail.
  const auto what = what_of<c10::Error>([] { TORCH_CHECK(false, "a torch check"); });
  CHECK(has_backtrace(what));
}

TEST_CASE("error: a bad balance says the numbers and nothing else", "[error]") {
  const auto what = what_of<c10::ValueError>(
      [] { gpipe::Pipe(layers(8), PipeOptions().balance({3, 4}).devices({torch::kCPU, torch::kCPU})); });
  CHECK(what ==
        "balance {3, 4} sums to 7 but the Sequential has 8 layers; pass one entry per stage "
        "summing to 8");
  CHECK_FALSE(has_backtrace(what));
  // Still a c10::Error to code that catches those.
  CHECK_THROWS_AS(gpipe::Pipe(layers(8), PipeOptions().balance({3, 4})), c10::Error);
}

TEST_CASE("error: counts of one read in the singular", "[error]") {
  CHECK(what_of<c10::ValueError>([] { gpipe::Pipe(layers(1), PipeOptions().balance({2})); }) ==
        "balance {2} sums to 2 but the Sequential has 1 layer; pass one entry per stage "
        "summing to 1");
  CHECK_THAT(what_of<c10::ValueError>([] { gpipe::Pipe(layers(2), PipeOptions().balance({1, 1, 0})); }),
             Contains("gives stage 2 0 layers"));
  CHECK_THAT(what_of<c10::ValueError>([] { gpipe::balance_cost({1.0}, 2); }),
             Contains("cannot cut 1 layer into 2 stages") && Contains("at most 1 partition"));
  const std::vector<c10::Device> one{torch::kCPU};
  CHECK_THAT(what_of<c10::IndexError>([&] { gpipe::Pipe(layers(2), PipeOptions().balance({1, 1}).devices(one)); }),
             Contains("only 1 device is given"));
}

TEST_CASE("error: each option check throws its message alone, typed for Python", "[error]") {
  torch::nn::Linear shared(2, 2);
  const std::vector<c10::Device> two(2, c10::Device(torch::kCPU));
  const std::vector<std::string> values = {
      what_of<c10::ValueError>([] { gpipe::Pipe(torch::nn::Sequential(), PipeOptions().balance({1})); }),
      what_of<c10::ValueError>([] { gpipe::Pipe(torch::nn::Sequential(nullptr), PipeOptions()); }),
      what_of<c10::ValueError>([&] {
        gpipe::Pipe(torch::nn::Sequential(shared, shared), PipeOptions().balance({1, 1}));
      }),
      what_of<c10::ValueError>([] { gpipe::Pipe(layers(2), PipeOptions().balance({2}).chunks(0)); }),
      what_of<c10::ValueError>([] { gpipe::Pipe(layers(2), PipeOptions().balance({3, -1})); }),
      what_of<c10::ValueError>([] { gpipe::balance_cost({1.0, -1.0}, 1); }),
      what_of<c10::ValueError>([] { gpipe::balance_cost({1.0}, 0); }),
      what_of<c10::ValueError>([] {
        gpipe::Pipe(layers(2), PipeOptions().balance({2}).trace_capacity(0));
      }),
  };
  for (const auto& what : values) {
    CAPTURE(what);
    CHECK_FALSE(what.empty());
    CHECK_FALSE(has_backtrace(what));
  }
  const auto index = what_of<c10::IndexError>(
      [&] { gpipe::Pipe(layers(3), PipeOptions().balance({1, 1, 1}).devices(two)); });
  CHECK_THAT(index, Contains("3 stages") && Contains("only 2 devices are given"));
  CHECK_FALSE(has_backtrace(index));
  gpipe::Pipe pipe(layers(2), PipeOptions().balance({2}));
  const auto out_of_range = what_of<c10::IndexError>([&] { pipe->ptr(5); });
  CHECK(out_of_range == "index 5 is out of range for a Pipe of 2 layers");
}
