// balance.h — choosing layers per stage: by profiled time, by memory, or by parameter count.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <optional>
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
  /// Where the layers run while profiled, one at a time (each moved there
  /// and back). Unset: where the model's first parameter or buffer is (the
  /// CPU if it has none).
  TORCH_ARG(std::optional<c10::Device>, device) = std::nullopt;
  /// balance_by_time: seconds to spend repeating the profile; at least
  /// `kMinRepeats` rounds are timed however small it is. Each layer's cost
  /// is its fastest forward+backward.
  TORCH_ARG(double, timeout) = 1.0;
  /// balance_by_size: the sample is cut into this many micro-batches and
  /// the first one is profiled, as training would see it.
  TORCH_ARG(int64_t, chunks) = 1;
  /// balance_by_size: parameter memory is counted this many times (the
  /// parameters, their grads, and optimizer state: 2 for SGD with momentum,
  /// 3 for Adam).
  TORCH_ARG(double, param_scale) = 2.0;
};

/// balance_by_time times every layer at least this many times (after one
/// warm-up round), however short the timeout: under load one timing can be
/// off by a whole scheduler time slice, many times the layer's own cost.
inline constexpr int64_t kMinRepeats = 3;

/// The contiguous split of `costs` (one per layer) into `partitions`
/// non-empty stages that minimises the most expensive stage, exactly (not
/// greedy). Among equally good splits, the one whose balance vector is
/// lexicographically smallest. Costs must be finite and non-negative;
/// `partitions` must be between 1 and the number of layers.
std::vector<int64_t> balance_cost(const std::vector<double>& costs, int64_t partitions);

/// Balance by parameter count (numel of each layer's parameters).
std::vector<int64_t> balance_by_params(int64_t partitions, torch::nn::Sequential module);

/// Balance by time: the forward+backward time of each layer on what the
/// previous layers make of `sample`. Profiling moves one layer at a time to
/// `options.device` and back before the next, keeping only the activation
/// between them there, so the device's peak is about the largest layer with
/// its grads and activations, not the whole model. The profile runs in
/// rounds through the layers: round 0 warms up and is not counted; rounds go
/// on until `options.timeout` seconds have passed, at least `kMinRepeats`
/// timed. A layer's cost is its fastest timed run: other work on the machine
/// only ever adds time to a run, and rounds spread a load that comes and
/// goes over all layers alike. The model's parameters, buffers, grads,
/// devices and training mode are left exactly as they were.
std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& sample, BalanceOptions options = {});

/// Balance by time for layers that take and return several tensors: the
/// first layer gets `sample` as a `std::vector<torch::Tensor>`, each later
/// one what the previous returned (a tensor or a vector of them).
std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential module,
                                     const std::vector<at::Tensor>& sample,
                                     BalanceOptions options = {});

/// Balance by memory: per layer, the bytes of its parameters times
/// `options.param_scale` plus the bytes of the activations its forward
/// keeps alive for backward (counted by the allocator's memory reports, on
/// CPU and CUDA alike), on the first of `options.chunks` micro-batches.
/// One layer at a time is on the device, as for `balance_by_time`; side
/// effects: none.
std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential module,
                                     const at::Tensor& input, BalanceOptions options = {});

/// Balance by memory for layers that take and return several tensors; each
/// tensor of `input` is cut along dim 0.
std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential module,
                                     const std::vector<at::Tensor>& input,
                                     BalanceOptions options = {});

}  // namespace gpipe
