// balance.h — choosing layers per stage: by profiled time, by memory, or by parameter count.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace gpipe {

/// Options for `balance_by_time` and `balance_by_size`.
///
/// Example:
/// ```
/// auto balance = gpipe::balance_by_time(4, model, sample,
///                                       gpipe::BalanceOptions().timeout(0.5));
/// ```
struct BalanceOptions {
  /// Where the layers run while profiled (moved there and back).
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
  /// balance_by_time: seconds to spend repeating the profile (at least one
  /// round runs); each layer's cost is its median forward+backward time.
  TORCH_ARG(double, timeout) = 1.0;
  /// balance_by_size: the sample is cut into this many micro-batches and
  /// the first one is profiled, as training would see it.
  TORCH_ARG(int64_t, chunks) = 1;
  /// balance_by_size: parameter memory is counted this many times (the
  /// parameters, their grads, and optimizer state: 2 for SGD with momentum,
  /// 3 for Adam).
  TORCH_ARG(double, param_scale) = 2.0;
};

/// The contiguous split of `costs` (one per layer) into `partitions`
/// non-empty stages that minimises the most expensive stage, exactly (not
/// greedy). Among equally good splits, the one whose balance vector is
/// lexicographically smallest. Costs must be finite and non-negative;
/// `partitions` must be between 1 and the number of layers.
std::vector<int64_t> balance_cost(const std::vector<double>& costs, int64_t partitions);

/// Balance by parameter count (numel of each layer's parameters).
std::vector<int64_t> balance_by_params(int64_t partitions, torch::nn::Sequential module);

/// Balance by time: runs each layer forward and backward on what the
/// previous layers make of `sample`, once to warm up, then repeatedly until
/// `options.timeout` (at least once),
/// and balances the median times. The model's parameters, buffers, grads,
/// devices and training mode are left exactly as they were.
std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& sample, BalanceOptions options = {});

/// Balance by memory: per layer, the bytes of its parameters times
/// `options.param_scale` plus the bytes of the activations its forward
/// keeps alive for backward (counted by the allocator's memory reports, on
/// CPU and CUDA alike). Side effects as for `balance_by_time`: none.
std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& input, BalanceOptions options = {});

}  // namespace gpipe
