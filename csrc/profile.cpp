// profile.cpp — per-layer time and memory on a sample, with the model restored afterwards.
#include "profile.h"

#include <gpipe/balance.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones_like.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>

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

at::Tensor as_tensor(torch::nn::AnyValue value, size_t layer) {
  auto* t = value.try_get<at::Tensor>();
  TORCH_CHECK(t != nullptr, "layer ", layer, " returned a ", value.type_info().name(),
              "; balancing by profile needs layers that take and return one tensor");
  return *t;
}

bool can_require_grad(const at::Tensor& t) { return t.is_floating_point() || t.is_complex(); }

// The layer's input for a graph-building run: a non-leaf copy, so layers
// that work in place are fine.
at::Tensor graph_input(const at::Tensor& x) {
  if (!can_require_grad(x)) return x;
  return x.detach().requires_grad_(true).clone();
}

void check_sample(const at::Tensor& sample) {
  TORCH_CHECK(sample.defined() && sample.dim() >= 1,
              "the sample must be a tensor with a batch dimension, got ",
              sample.defined() ? "a 0-dimensional tensor" : "an undefined tensor");
}

}  // namespace

std::vector<double> layer_times(torch::nn::Sequential model, const at::Tensor& sample,
                                c10::Device device, double timeout) {
  check_sample(sample);
  const size_t n = model->size();
  std::vector<std::vector<double>> seconds(n);
  std::vector<at::Tensor> inputs(n);
  at::AutoGradMode grad(true);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Pass 0 warms up (the first backward starts autograd's threads,
  // allocators fill) and is not counted; then at least one counted pass.
  for (int64_t pass = 0;; ++pass) {
    at::Tensor x = sample.to(device);
    size_t i = 0;
    for (auto& layer : *model) {
      at::Tensor in = graph_input(inputs[i].defined() ? inputs[i] : x);
      synchronize(device);
      const auto t0 = Clock::now();
      at::Tensor y = as_tensor(layer.any_forward(in), i);
      if (y.requires_grad()) torch::autograd::backward({y}, {at::ones_like(y)});
      synchronize(device);
      if (pass > 0) seconds[i].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      if (!inputs[i].defined()) inputs[i] = x;
      x = y.detach();
      ++i;
    }
    if (pass > 0 && std::chrono::duration<double>(Clock::now() - start).count() >= timeout) break;
  }

  std::vector<double> medians;
  for (auto& s : seconds) {
    std::sort(s.begin(), s.end());
    medians.push_back(s[s.size() / 2]);
  }
  return medians;
}

std::vector<double> layer_sizes(torch::nn::Sequential model, const at::Tensor& input,
                                c10::Device device, double param_scale) {
  check_sample(input);
  TORCH_CHECK(param_scale >= 0, "param_scale must be non-negative, got ", param_scale);
  std::vector<double> bytes;
  at::AutoGradMode grad(true);
  at::Tensor x = input.to(device);
  size_t i = 0;
  for (auto& layer : *model) {
    double params = 0;
    for (const auto& p : layer.ptr()->parameters()) params += static_cast<double>(p.nbytes());
    at::Tensor in = graph_input(x);
    at::Tensor y;
    int64_t kept = 0;
    {
      CountMemory count;
      y = as_tensor(layer.any_forward(in), i);
      kept = count.counter().current();  // the output and what backward will need
    }
    bytes.push_back(params * param_scale + static_cast<double>(std::max<int64_t>(kept, 0)));
    x = y.detach();
    ++i;
  }
  return bytes;
}

}  // namespace gpipe::detail

namespace gpipe {

std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& sample, BalanceOptions options) {
  TORCH_CHECK(options.timeout() >= 0, "timeout must be non-negative, got ", options.timeout());
  detail::ModelSnapshot snapshot(*module);
  module->train();
  module->to(options.device());
  return balance_cost(detail::layer_times(module, sample, options.device(), options.timeout()),
                      partitions);
}

std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& input, BalanceOptions options) {
  TORCH_CHECK(options.chunks() >= 1, "chunks must be at least 1, got ", options.chunks());
  detail::ModelSnapshot snapshot(*module);
  module->train();
  module->to(options.device());
  at::Tensor microbatch = input.dim() >= 1 ? input.chunk(options.chunks(), 0).front() : input;
  return balance_cost(
      detail::layer_sizes(module, microbatch, options.device(), options.param_scale()),
      partitions);
}

}  // namespace gpipe
