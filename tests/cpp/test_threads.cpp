// test_threads.cpp — CPU stages split the intra-op threads between them; the caller's count stays.
#include "engine.h"

#include <gpipe/gpipe.h>

#include <ATen/Parallel.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <mutex>
#include <set>
#include <thread>
#include <vector>

using Catch::Contains;
using gpipe::PipeOptions;
using gpipe::detail::intra_op_split;

namespace {

// Identity that records the intra-op thread count of the thread running its
// forward (first forward and recompute) and its backward.
class ThreadCountProbeImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(const torch::Tensor& x) {
    note(forward_);
    auto y = x.clone();
    if (y.requires_grad()) {
      y.register_hook([this](const torch::Tensor& grad) {
        note(backward_);
        return grad;
      });
    }
    return y;
  }
  std::set<int> forward_seen() {
    std::lock_guard<std::mutex> hold(mutex_);
    return forward_;
  }
  std::set<int> backward_seen() {
    std::lock_guard<std::mutex> hold(mutex_);
    return backward_;
  }

 private:
  void note(std::set<int>& into) {
    const int n = at::get_num_threads();
    std::lock_guard<std::mutex> hold(mutex_);
    into.insert(n);
  }
  std::mutex mutex_;
  std::set<int> forward_;
  std::set<int> backward_;
};
TORCH_MODULE(ThreadCountProbe);

// Sets the calling thread's (and the process-wide) intra-op count for a
// test, and puts the previous one back.
class CallerThreads {
 public:
  explicit CallerThreads(int n) : previous_(at::get_num_threads()) { at::set_num_threads(n); }
  ~CallerThreads() { at::set_num_threads(previous_); }
  CallerThreads(const CallerThreads&) = delete;
  CallerThreads& operator=(const CallerThreads&) = delete;

 private:
  int previous_;
};

// The count a thread started now gets on its first at:: call.
int new_thread_count() {
  int n = 0;
  std::thread([&] { n = at::get_num_threads(); }).join();
  return n;
}

struct Probed {
  torch::nn::Sequential model;
  std::vector<ThreadCountProbe> probes;
};

// `stages` stages of Linear + probe (the probe last, so it sees the stage's
// backward first).
Probed probed_model(int64_t stages) {
  Probed p;
  for (int64_t j = 0; j < stages; ++j) {
    p.model->push_back(torch::nn::Linear(4, 4));
    p.probes.emplace_back();
    p.model->push_back(p.probes.back());
  }
  return p;
}

std::vector<c10::Device> cpus(size_t n) { return std::vector<c10::Device>(n, torch::kCPU); }

// Runs a training step (forward + backward, default checkpointing, so the
// recompute is recorded too) and returns the counts each stage saw.
std::vector<std::set<int>> step(Probed& p, PipeOptions options) {
  const auto stages = static_cast<int64_t>(p.probes.size());
  options.balance(std::vector<int64_t>(static_cast<size_t>(stages), 2))
      .devices(cpus(static_cast<size_t>(stages)))
      .chunks(3);
  gpipe::Pipe pipe(p.model, options);
  pipe->forward(torch::randn({6, 4})).sum().backward();
  std::vector<std::set<int>> seen;
  for (auto& probe : p.probes) {
    auto f = probe->forward_seen();
    auto b = probe->backward_seen();
    CHECK(b == f);  // backward runs with the same count as forward
    seen.push_back(f);
  }
  return seen;
}

}  // namespace

TEST_CASE("threads: the automatic split gives each CPU stage its share, at least 1", "[threads]") {
  CHECK(intra_op_split(cpus(2), 0, 2) == std::vector<int>{1, 1});
  CHECK(intra_op_split(cpus(2), 0, 8) == std::vector<int>{4, 4});
  CHECK(intra_op_split(cpus(2), 0, 5) == std::vector<int>{3, 2});
  CHECK(intra_op_split(cpus(3), 0, 8) == std::vector<int>{3, 3, 2});
  CHECK(intra_op_split(cpus(3), 0, 2) == std::vector<int>{1, 1, 1});
  CHECK(intra_op_split(cpus(1), 0, 6) == std::vector<int>{6});
  // Accelerator stages are left alone and do not count.
  const std::vector<c10::Device> mixed{torch::kCPU, c10::Device(c10::kCUDA, 0), torch::kCPU};
  CHECK(intra_op_split(mixed, 0, 4) == std::vector<int>{2, 0, 2});
  CHECK(intra_op_split({c10::Device(c10::kCUDA, 0)}, 0, 4) == std::vector<int>{0});
}

TEST_CASE("threads: a positive count is given to every CPU stage, -1 sets nothing", "[threads]") {
  CHECK(intra_op_split(cpus(3), 2, 8) == std::vector<int>{2, 2, 2});
  const std::vector<c10::Device> mixed{torch::kCPU, c10::Device(c10::kCUDA, 0)};
  CHECK(intra_op_split(mixed, 3, 1) == std::vector<int>{3, 0});
  CHECK(intra_op_split(cpus(2), -1, 8) == std::vector<int>{0, 0});
}

TEST_CASE("threads: an intra_op_threads below -1 is refused, naming the value and the choices",
          "[threads][options]") {
  auto p = probed_model(2);
  auto make = [&] {
    return gpipe::Pipe(p.model, PipeOptions().balance({2, 2}).devices(cpus(2)).intra_op_threads(-2));
  };
  REQUIRE_THROWS_AS(make(), c10::Error);
  CHECK_THROWS_WITH(make(), Contains("intra_op_threads is -2") && Contains("pass 0") &&
                                Contains("-1 to leave"));
  CHECK(PipeOptions().intra_op_threads() == 0);
}

TEST_CASE("threads: by default the CPU stages' workers split the caller's threads", "[threads]") {
  // More threads than this machine may have cores: OpenMP allows it, and it
  // makes the split visible on a 2-core machine.
  CallerThreads caller(4);
  {
    auto p = probed_model(2);
    CHECK(step(p, PipeOptions()) == std::vector<std::set<int>>{{2}, {2}});
  }
  {
    auto p = probed_model(3);
    CHECK(step(p, PipeOptions()) == std::vector<std::set<int>>{{2}, {1}, {1}});
  }
  // The caller keeps its count, and so does a thread started afterwards.
  CHECK(at::get_num_threads() == 4);
  CHECK(new_thread_count() == 4);
}

TEST_CASE("threads: intra_op_threads overrides the split, -1 leaves torch's count", "[threads]") {
  CallerThreads caller(4);
  {
    auto p = probed_model(2);
    CHECK(step(p, PipeOptions().intra_op_threads(3)) == std::vector<std::set<int>>{{3}, {3}});
  }
  {
    auto p = probed_model(2);
    CHECK(step(p, PipeOptions().intra_op_threads(-1)) == std::vector<std::set<int>>{{4}, {4}});
  }
  CHECK(at::get_num_threads() == 4);
  CHECK(new_thread_count() == 4);
}

TEST_CASE("threads: the caller's count is unchanged by building, forward and backward",
          "[threads]") {
  CallerThreads caller(3);
  auto p = probed_model(2);
  gpipe::Pipe pipe(p.model, PipeOptions().balance({2, 2}).devices(cpus(2)).chunks(2));
  CHECK(at::get_num_threads() == 3);
  CHECK(new_thread_count() == 3);
  auto y = pipe->forward(torch::randn({4, 4}));
  CHECK(at::get_num_threads() == 3);
  y.sum().backward();
  CHECK(at::get_num_threads() == 3);
  CHECK(new_thread_count() == 3);
  // The workers keep their split when the caller changes its count later.
  at::set_num_threads(1);
  pipe->forward(torch::randn({4, 4})).sum().backward();
  CHECK(p.probes[0]->forward_seen() == std::set<int>{2});
  CHECK(at::get_num_threads() == 1);
}
