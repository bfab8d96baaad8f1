// models.h — small float64 models, instrumented layers and comparison helpers for the Pipe contract tests.
//
// Micro-batch markers: `marked_input` writes, in column 0 of every row, the
// index of the micro-batch the Pipe will put that row in (pieces whose sizes
// differ by at most one, the larger first). Layers that must know which micro-batch they see read it back
// with `marker_of`, and `MarkedLinear` carries column 0 through unchanged, so
// the marker survives any number of stages.
#pragma once

#include <gpipe/gpipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace gpipe_test {

/// Pipe and Sequential differ at most by float summation order (float64).
constexpr double kTolerance = 1e-10;

using Clock = std::chrono::steady_clock;

// ---- comparing -----------------------------------------------------------------

/// Largest elementwise |a - b|; infinity when one is undefined or shapes differ
/// (two undefined tensors compare equal: 0).
inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return a.defined() == b.defined() ? 0.0 : std::numeric_limits<double>::infinity();
  }
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  if (a.numel() == 0) return 0.0;
  return (a.detach().to(torch::kFloat64) - b.detach().to(torch::kFloat64))
      .abs()
      .max()
      .item<double>();
}

template <typename V>
std::vector<std::string> keys_of(const torch::OrderedDict<std::string, V>& dict) {
  std::vector<std::string> keys;
  for (const auto& item : dict) keys.push_back(item.key());
  return keys;
}

/// Every parameter of `ref` has a grad within kTolerance of the parameter of
/// the same name in `pipe` (and the names are the same).
inline void check_param_grads(const torch::nn::Module& pipe, const torch::nn::Module& ref) {
  const auto got = pipe.named_parameters();
  const auto want = ref.named_parameters();
  REQUIRE(keys_of(got) == keys_of(want));
  for (const auto& item : want) {
    INFO("parameter " << item.key());
    const auto& g = got[item.key()].grad();
    REQUIRE(item.value().grad().defined());
    REQUIRE(g.defined());
    CHECK(max_abs_diff(g, item.value().grad()) <= kTolerance);
  }
}

/// Every parameter of both modules has the same value (within kTolerance).
inline void check_param_values(const torch::nn::Module& pipe, const torch::nn::Module& ref) {
  const auto got = pipe.named_parameters();
  const auto want = ref.named_parameters();
  REQUIRE(keys_of(got) == keys_of(want));
  for (const auto& item : want) {
    INFO("parameter " << item.key());
    CHECK(max_abs_diff(got[item.key()], item.value()) <= kTolerance);
  }
}

inline void zero_grads(torch::nn::Module& module) {
  for (auto& p : module.parameters()) p.mutable_grad().reset();
}

// ---- models ---------------------------------------------------------------------

/// A deep copy: the plain reference a Pipe is compared with. Take it before
/// the Pipe adopts the layers.
inline torch::nn::Sequential deep_copy(const torch::nn::Sequential& model) {
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  REQUIRE(copy != nullptr);
  return torch::nn::Sequential(copy);
}

/// Linear(4,8) ReLU_ Linear(8,8) LeakyReLU_ Linear(8,3) Tanh, float64. The
/// in-place layers start a stage under balances {1,2,3} and {1,1,1,1,1,1}.
/// LeakyReLU is not idempotent: applied twice to the same input (a
/// checkpoint that kept no copy of it) it changes the result.
inline torch::nn::Sequential inplace_mlp(uint64_t seed = 0) {
  torch::manual_seed(seed);
  using namespace torch::nn;
  Sequential model(Linear(4, 8), ReLU(ReLUOptions().inplace(true)), Linear(8, 8),
                   LeakyReLU(LeakyReLUOptions().negative_slope(0.1).inplace(true)), Linear(8, 3),
                   Tanh());
  model->to(torch::kFloat64);
  return model;
}

inline torch::Tensor randn64(std::vector<int64_t> sizes) {
  return torch::randn(sizes, torch::kFloat64);
}

/// `rows` x `cols` float64 values whose column 0 holds each row's micro-batch
/// index under `chunks` (min(rows, chunks) pieces, the first rows % pieces
/// of them one row longer).
inline torch::Tensor marked_input(int64_t rows, int64_t cols, int64_t chunks) {
  auto x = randn64({rows, cols});
  const int64_t pieces = std::min(rows, chunks);
  int64_t r = 0;
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t size = rows / pieces + (i < rows % pieces ? 1 : 0);
    for (int64_t end = r + size; r < end; ++r) x[r][0] = static_cast<double>(i);
  }
  return x;
}

/// The micro-batch index carried by column 0 of `x` (see marked_input).
inline int64_t marker_of(const torch::Tensor& x) {
  return static_cast<int64_t>(x[0][0].item<double>());
}

/// Linear on columns 1.. ; column 0 (the marker) passes through untouched.
class MarkedLinearImpl : public torch::nn::Cloneable<MarkedLinearImpl> {
 public:
  MarkedLinearImpl(int64_t in, int64_t out) : in_(in), out_(out) { reset(); }
  void reset() override {
    linear = register_module("linear", torch::nn::Linear(in_, out_));
    linear->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::cat({x.narrow(1, 0, 1), linear(x.narrow(1, 1, in_))}, 1);
  }
  torch::nn::Linear linear{nullptr};

 private:
  int64_t in_;
  int64_t out_;
};
TORCH_MODULE(MarkedLinear);

// ---- instrumented layers ----------------------------------------------------------

/// Something that wants to hear when backward reaches one of its layers.
class BackwardListener {
 public:
  virtual ~BackwardListener() = default;
  virtual void on_backward(int64_t microbatch) = 0;
};

/// Identity whose backward calls `listener->on_backward(microbatch)` first.
/// The listener is a layer, which outlives every graph through it.
struct BackwardTap : torch::autograd::Function<BackwardTap> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               BackwardListener* listener, int64_t microbatch) {
    ctx->saved_data["listener"] = reinterpret_cast<int64_t>(listener);
    ctx->saved_data["microbatch"] = microbatch;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* listener = reinterpret_cast<BackwardListener*>(ctx->saved_data["listener"].toInt());
    listener->on_backward(ctx->saved_data["microbatch"].toInt());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

/// One cell of work as a layer saw it: 'F' forward, 'B' backward.
struct CellEvent {
  int64_t stage;
  int64_t microbatch;
  char phase;
  Clock::time_point start;
  Clock::time_point end;
  std::thread::id thread;
};

class CellLog {
 public:
  void add(CellEvent e) {
    std::lock_guard<std::mutex> hold(mutex_);
    events_.push_back(e);
  }
  std::vector<CellEvent> events() const {
    std::lock_guard<std::mutex> hold(mutex_);
    return events_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<CellEvent> events_;
};

/// Identity that sleeps `nap` in forward and in backward and logs both.
class SleepImpl : public torch::nn::Cloneable<SleepImpl>, public BackwardListener {
 public:
  SleepImpl(int64_t stage, std::shared_ptr<CellLog> log, std::chrono::milliseconds nap)
      : stage_(stage), log_(std::move(log)), nap_(nap) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto start = Clock::now();
    std::this_thread::sleep_for(nap_);
    const int64_t mb = marker_of(x);
    auto y = BackwardTap::apply(x, static_cast<BackwardListener*>(this), mb);
    log_->add({stage_, mb, 'F', start, Clock::now(), std::this_thread::get_id()});
    return y;
  }
  void on_backward(int64_t mb) override {
    const auto start = Clock::now();
    std::this_thread::sleep_for(nap_);
    log_->add({stage_, mb, 'B', start, Clock::now(), std::this_thread::get_id()});
  }

 private:
  int64_t stage_;
  std::shared_ptr<CellLog> log_;
  std::chrono::milliseconds nap_;
};
TORCH_MODULE(Sleep);

/// What a Probe saw on one forward call.
struct ProbeRecord {
  int64_t stage;
  int64_t microbatch;
  bool checkpointing;
  bool recomputing;
};

class ProbeLog {
 public:
  void add(ProbeRecord r) {
    std::lock_guard<std::mutex> hold(mutex_);
    records_.push_back(r);
  }
  std::vector<ProbeRecord> take() {
    std::lock_guard<std::mutex> hold(mutex_);
    return std::exchange(records_, {});
  }

 private:
  std::mutex mutex_;
  std::vector<ProbeRecord> records_;
};

/// Doubles its input and records gpipe::is_checkpointing / is_recomputing.
class ProbeImpl : public torch::nn::Cloneable<ProbeImpl> {
 public:
  ProbeImpl(int64_t stage, std::shared_ptr<ProbeLog> log) : stage_(stage), log_(std::move(log)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    log_->add({stage_, marker_of(x), gpipe::is_checkpointing(), gpipe::is_recomputing()});
    return x * 2.0;
  }

 private:
  int64_t stage_;
  std::shared_ptr<ProbeLog> log_;
};
TORCH_MODULE(Probe);

enum class FaultPhase { Forward, Backward, Recompute };

inline const char* phase_word(FaultPhase p) {
  switch (p) {
    case FaultPhase::Forward:
      return "forward";
    case FaultPhase::Backward:
      return "backward";
    case FaultPhase::Recompute:
      return "recompute";
  }
  return "?";
}

/// Which cell a Thrower fails, shared by all Throwers of a model (and its copy).
struct FaultPlan {
  std::atomic<bool> armed{false};
  std::atomic<int64_t> stage{-1};
  std::atomic<int64_t> microbatch{-1};
  std::atomic<FaultPhase> phase{FaultPhase::Forward};

  void arm(int64_t s, int64_t mb, FaultPhase p) {
    stage = s;
    microbatch = mb;
    phase = p;
    armed = true;
  }
  void disarm() { armed = false; }
  bool hits(int64_t s, int64_t mb, FaultPhase p) const {
    return armed && stage == s && microbatch == mb && phase == p;
  }
};

/// Identity that throws std::runtime_error("boom at stage S") where its plan
/// says: in forward, in recompute (only while gpipe::is_recomputing()), or
/// from its backward.
class ThrowerImpl : public torch::nn::Cloneable<ThrowerImpl>, public BackwardListener {
 public:
  ThrowerImpl(int64_t stage, std::shared_ptr<FaultPlan> plan) : stage_(stage), plan_(std::move(plan)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t mb = marker_of(x);
    if (gpipe::is_recomputing() ? plan_->hits(stage_, mb, FaultPhase::Recompute)
                                : plan_->hits(stage_, mb, FaultPhase::Forward)) {
      boom();
    }
    return BackwardTap::apply(x, static_cast<BackwardListener*>(this), mb);
  }
  void on_backward(int64_t mb) override {
    if (plan_->hits(stage_, mb, FaultPhase::Backward)) boom();
  }
  std::string message() const { return "boom at stage " + std::to_string(stage_); }

 private:
  void boom() const { throw std::runtime_error(message()); }
  int64_t stage_;
  std::shared_ptr<FaultPlan> plan_;
};
TORCH_MODULE(Thrower);

/// `stages` stages of [MarkedLinear, Thrower(j)] (balance 2 per stage): real
/// parameters, and the marker in column 0 survives to tell each Thrower its
/// micro-batch.
inline torch::nn::Sequential faulty_model(const std::shared_ptr<FaultPlan>& plan,
                                          int64_t stages) {
  torch::manual_seed(4);
  torch::nn::Sequential model;
  for (int64_t j = 0; j < stages; ++j) {
    model->push_back(MarkedLinear(5, 5));
    model->push_back(Thrower(j, plan));
  }
  return model;
}

// ---- running without hanging ---------------------------------------------------------

/// Runs `fn` on another thread and returns its result (or rethrows its
/// exception). Should it not finish within `limit`, a gpipe thread hangs: the
/// process says so and exits at once, so the suite fails instead of hanging.
template <typename Fn>
auto within_deadline(Fn&& fn, std::chrono::seconds limit = std::chrono::seconds(60)) {
  auto result = std::async(std::launch::async, std::forward<Fn>(fn));
  if (result.wait_for(limit) == std::future_status::timeout) {
    std::cerr << "FATAL in test case \"" << Catch::getResultCapture().getCurrentTestName()
              << "\": a Pipe call did not return within " << limit.count()
              << " s: some thread hangs. Exiting without waiting for it." << std::endl;
    std::quick_exit(3);
  }
  return result.get();
}

/// A training step on `x` that is meant to fail, then `pipe` dropped: the
/// seconds the drop took, all under the hang deadline. With `keep_output` a
/// failed backward's output (whose graph still refers to the engine) lives
/// until after the drop.
inline double seconds_to_drop_after_failure(gpipe::Pipe& pipe, const torch::Tensor& x,
                                            bool keep_output,
                                            std::chrono::seconds limit = std::chrono::seconds(60)) {
  return within_deadline(
      [&] {
        // A failed forward leaves no output; a failed backward may leave one.
        torch::Tensor out;
        try {
          out = pipe->forward(x);
          out.sum().backward({}, /*retain_graph=*/keep_output);
        } catch (const gpipe::CellError&) {
        }
        if (!keep_output) out = torch::Tensor();
        const auto start = Clock::now();
        pipe = gpipe::Pipe(nullptr);
        out = torch::Tensor();
        return std::chrono::duration<double>(Clock::now() - start).count();
      },
      limit);
}

/// tanh(x W^T) with a W it is given: layers built on one W share it (a
/// weight tied across layers, as a GPT's embedding and lm_head). clone()
/// unties them: build each copy of such a model afresh.
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

/// Sets an environment variable (or unsets it, for nullptr) for the scope,
/// then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ScopedEnv() { set(old_ ? old_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const char* value) {
    if (value) {
      setenv(name_, value, 1);
    } else {
      unsetenv(name_);
    }
  }
  const char* name_;
  std::optional<std::string> old_;
};

/// x @ weight, with `weight` given: two of these share one parameter (tied weights).
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

}  // namespace gpipe_test
