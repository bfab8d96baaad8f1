// profile.h — measuring layers for balancing (time, memory) without leaving a trace on the model.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace gpipe::detail {

/// Snapshot of everything profiling may touch: parameter storage, values and
/// grads, buffer storage and values, devices, training mode. Restores it on
/// destruction. Grads read as undefined while the snapshot is alive.
class ModelSnapshot {
 public:
  explicit ModelSnapshot(const torch::nn::Module& model);
  ~ModelSnapshot();
  ModelSnapshot(const ModelSnapshot&) = delete;
  ModelSnapshot& operator=(const ModelSnapshot&) = delete;

 private:
  struct Param {
    at::Tensor param, data, grad;
  };
  struct Buffer {
    at::Tensor buffer, data, values;
  };
  std::vector<Param> params_;
  std::vector<Buffer> buffers_;
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> training_;
};

/// Counts, on the calling thread, the bytes allocated minus the bytes freed
/// (on any device) while it is installed: the allocators' memory reports,
/// the same the profiler uses.
class MemoryCounter : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t total_allocated,
                         size_t total_reserved, c10::Device device) override;
  bool memoryProfilingEnabled() const override { return true; }
  int64_t current() const noexcept { return current_; }
  int64_t peak() const noexcept { return peak_; }

 private:
  int64_t current_ = 0;
  int64_t peak_ = 0;
};

/// Installs a fresh MemoryCounter on this thread for its lifetime.
class CountMemory {
 public:
  CountMemory();
  const MemoryCounter& counter() const noexcept { return *counter_; }

 private:
  std::shared_ptr<MemoryCounter> counter_;
  c10::DebugInfoGuard guard_;
};

/// Waits for the device's queued work (nothing on CPU).
void synchronize(c10::Device device);

/// What flows between layers while profiling: one tensor, or several (a
/// layer then gets them as one std::vector<at::Tensor>).
struct Activation {
  std::vector<at::Tensor> tensors;
  bool single = true;
};

/// Fastest forward+backward seconds of each layer on what the previous
/// layers make of `sample`, one layer at a time on `device`, in rounds for
/// about `timeout` seconds (at least kMinRepeats timed).
std::vector<double> layer_times(torch::nn::Sequential model, const Activation& sample,
                                c10::Device device, double timeout);

/// Bytes of each layer: parameters × param_scale + activations its forward
/// keeps for backward, one layer at a time on `device`.
std::vector<double> layer_sizes(torch::nn::Sequential model, const Activation& input,
                                c10::Device device, double param_scale);

}  // namespace gpipe::detail
