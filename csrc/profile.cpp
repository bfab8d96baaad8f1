// profile.cpp — per-layer time and memory on a sample, with the model restored afterwards.
#include "profile.h"

#include <gpipe/balance.h>
#include <gpipe/skip.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones_like.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>

namespace gpipe::detail {

ModelSnapshot::ModelSnapshot(const torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    params_.push_back({p, p.data(), p.grad()});
    p.mutable_grad() = at::Tensor();
  }
  for (auto& b : model.buffers()) {
    buffers_.push_back({b, b.data(), b.defined() ? b.clone() : at::Tensor()});
  }
  for (const auto& m : model.modules(/*include_self=*/true)) training_.emplace_back(m, m->is_training());
}

ModelSnapshot::~ModelSnapshot() {
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    p.param.set_data(p.data);
    p.param.mutable_grad() = p.grad;
  }
  for (auto& b : buffers_) {
    if (!b.buffer.defined()) continue;
    b.buffer.set_data(b.data);
    b.buffer.copy_(b.values);
  }
  // Parents first (modules() is pre-order): train() also sets the children,
  // which then get their own flag back.
  for (auto& [module, training] : training_) module->train(training);
}

void MemoryCounter::reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                                      size_t /*total_reserved*/, c10::Device /*device*/) {
  current_ += alloc_size;
  peak_ = std::max(peak_, current_);
}

CountMemory::CountMemory()
    : counter_(std::make_shared<MemoryCounter>()),
      guard_(c10::DebugInfoKind::PROFILER_STATE, counter_) {}

void synchronize(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.synchronizeDevice(device.has_index() ? device.index() : impl.getDevice().index());
}

namespace {

bool can_require_grad(const at::Tensor& t) { return t.is_floating_point() || t.is_complex(); }

// What a layer returned, checked: a tensor or a vector of them.
Activation as_activation(torch::nn::AnyValue value, size_t layer) {
  if (auto* t = value.try_get<at::Tensor>()) return {{*t}, true};
  if (auto* ts = value.try_get<std::vector<at::Tensor>>()) return {*ts, false};
  TORCH_CHECK(false, "layer ", layer, " returned a ", value.type_info().name(),
              "; balancing by profile needs layers that return torch::Tensor or "
              "std::vector<torch::Tensor>");
}

Activation map(const Activation& x, const std::function<at::Tensor(const at::Tensor&)>& f) {
  Activation y{{}, x.single};
  for (const auto& t : x.tensors) y.tensors.push_back(f(t));
  return y;
}

// The layer's input for a graph-building run: non-leaf copies, so layers
// that work in place are fine.
Activation graph_input(const Activation& x) {
  return map(x, [](const at::Tensor& t) {
    return can_require_grad(t) ? t.detach().requires_grad_(true).clone() : t;
  });
}

// A skip waiting for its pop, as the popping layer's own graph input (on
// the profiling device): each layer's backward stays within that layer.
at::Tensor skip_input(const at::Tensor& t, c10::Device device) {
  if (!t.defined()) return t;
  at::Tensor on = t.detach().to(device);
  return can_require_grad(on) ? on.requires_grad_(true) : on;
}

Activation detached(const Activation& x) {
  return map(x, [](const at::Tensor& t) { return t.detach(); });
}

torch::nn::AnyValue call(torch::nn::AnyModule& layer, const Activation& x) {
  return x.single ? layer.any_forward(x.tensors.front()) : layer.any_forward(x.tensors);
}

void check_sample(const Activation& sample) {
  TORCH_CHECK(!sample.tensors.empty(), "the sample is an empty list of tensors; pass at least one");
  for (const auto& t : sample.tensors) {
    TORCH_CHECK(t.defined() && t.dim() >= 1,
                "the sample must be tensors with a batch dimension, got ",
                t.defined() ? "a 0-dimensional tensor" : "an undefined tensor");
  }
}

// Where the model is: profiling there moves nothing it need not.
c10::Device device_of(const torch::nn::Module& model, const BalanceOptions& options) {
  if (options.device()) return *options.device();
  for (const auto& p : model.parameters()) return p.device();
  for (const auto& b : model.buffers()) {
    if (b.defined()) return b.device();
  }
  return c10::Device(c10::kCPU);
}

}  // namespace

std::vector<double> layer_times(torch::nn::Sequential model, const Activation& sample,
                                c10::Device device, double timeout) {
  check_sample(sample);
  const size_t n = model->size();
  std::vector<std::vector<double>> seconds(n);
  at::AutoGradMode grad(true);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Round 0 warms up (the first backward starts autograd's threads,
  // allocators fill) and is not counted.
  for (int64_t round = 0;; ++round) {
    Activation x = map(sample, [&](const at::Tensor& t) { return t.to(device); });
    SkipTracker skips;
    UseSkipTracker use(skips);
    size_t i = 0;
    for (auto& layer : *model) {
      // This layer alone on the device; back where it was at the end of
      // the scope, with the grads it made there dropped.
      ModelSnapshot resident(*layer.ptr());
      layer.ptr()->to(device);
      Activation in = graph_input(x);
      skips.transform([&](const at::Tensor& t) { return skip_input(t, device); });
      synchronize(device);
      const auto t0 = Clock::now();
      Activation y = as_activation(call(layer, in), i);
      std::vector<at::Tensor> outputs, grads;
      for (const auto& t : y.tensors) {
        if (t.requires_grad()) {
          outputs.push_back(t);
          grads.push_back(at::ones_like(t));
        }
      }
      if (!outputs.empty()) torch::autograd::backward(outputs, grads);
      synchronize(device);
      if (round > 0) seconds[i].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      x = detached(y);
      ++i;
    }
    if (round >= kMinRepeats &&
        std::chrono::duration<double>(Clock::now() - start).count() >= timeout) {
      break;
    }
  }

  std::vector<double> fastest;
  for (const auto& s : seconds) fastest.push_back(*std::min_element(s.begin(), s.end()));
  return fastest;
}

std::vector<double> layer_sizes(torch::nn::Sequential model, const Activation& input,
                                c10::Device device, double param_scale) {
  check_sample(input);
  TORCH_CHECK(param_scale >= 0, "param_scale must be non-negative, got ", param_scale);
  std::vector<double> bytes;
  at::AutoGradMode grad(true);
  Activation x = map(input, [&](const at::Tensor& t) { return t.to(device); });
  SkipTracker skips;
  UseSkipTracker use(skips);
  size_t i = 0;
  for (auto& layer : *model) {
    ModelSnapshot resident(*layer.ptr());
    layer.ptr()->to(device);
    double params = 0;
    for (const auto& p : layer.ptr()->parameters()) params += static_cast<double>(p.nbytes());
    Activation in = graph_input(x);
    skips.transform([&](const at::Tensor& t) { return skip_input(t, device); });
    std::optional<torch::nn::AnyValue> y;
    int64_t kept = 0;
    {
      CountMemory count;
      y.emplace(call(layer, in));
      kept = count.counter().current();  // the output and what backward will need
    }
    bytes.push_back(params * param_scale + static_cast<double>(std::max<int64_t>(kept, 0)));
    x = detached(as_activation(std::move(*y), i));
    ++i;
  }
  return bytes;
}

}  // namespace gpipe::detail

namespace gpipe {

namespace {

std::vector<int64_t> by_time(int64_t partitions, torch::nn::Sequential module,
                             const detail::Activation& sample, const BalanceOptions& options) {
  TORCH_CHECK(options.timeout() >= 0, "timeout must be non-negative, got ", options.timeout());
  const auto device = detail::device_of(*module, options);
  detail::ModelSnapshot snapshot(*module);
  module->train();
  return balance_cost(detail::layer_times(module, sample, device, options.timeout()), partitions);
}

std::vector<int64_t> by_size(int64_t partitions, torch::nn::Sequential module,
                             const detail::Activation& input, const BalanceOptions& options) {
  TORCH_CHECK(options.chunks() >= 1, "chunks must be at least 1, got ", options.chunks());
  const auto device = detail::device_of(*module, options);
  detail::ModelSnapshot snapshot(*module);
  module->train();
  detail::Activation microbatch = input;
  for (auto& t : microbatch.tensors) {
    if (t.defined() && t.dim() >= 1) t = t.chunk(options.chunks(), 0).front();
  }
  return balance_cost(detail::layer_sizes(module, microbatch, device, options.param_scale()),
                      partitions);
}

}  // namespace

std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& sample, BalanceOptions options) {
  return by_time(partitions, std::move(module), {{sample}, true}, options);
}

std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential module,
                                     const std::vector<at::Tensor>& sample,
                                     BalanceOptions options) {
  return by_time(partitions, std::move(module), {sample, false}, options);
}

std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& input, BalanceOptions options) {
  return by_size(partitions, std::move(module), {{input}, true}, options);
}

std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential module,
                                     const std::vector<at::Tensor>& input,
                                     BalanceOptions options) {
  return by_size(partitions, std::move(module), {input, false}, options);
}

}  // namespace gpipe
