// microbatch.h — cutting a batch into micro-batches along dim 0 and gathering them back.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gpipe::detail {

/// What flows between stages: one tensor (`atomic`) or several.
struct Batch {
  std::vector<at::Tensor> values;
  /// True when the value is a single tensor rather than a list of them.
  bool atomic = true;

  Batch() = default;
  explicit Batch(at::Tensor tensor) : values{std::move(tensor)}, atomic(true) {}
  Batch(std::vector<at::Tensor> tensors, bool is_atomic)
      : values(std::move(tensors)), atomic(is_atomic) {}

  size_t size() const noexcept { return values.size(); }
  at::Tensor& operator[](size_t i) { return values[i]; }
  const at::Tensor& operator[](size_t i) const { return values[i]; }
};

/// Cuts every tensor of `batch` into the same pieces along dim 0, like
/// `at::chunk`: pieces of ceil(rows / chunks) rows, the last one possibly
/// smaller, and fewer than `chunks` pieces when there are too few rows.
/// Every tensor must have at least one dimension and the same number of rows.
std::vector<Batch> scatter(const Batch& batch, int64_t chunks);

/// Concatenates the micro-batches back along dim 0, value by value. A single
/// micro-batch comes back as it is.
Batch gather(const std::vector<Batch>& microbatches);

/// Rows of each micro-batch (dim 0 of its first tensor).
std::vector<int64_t> rows_of(const std::vector<Batch>& microbatches);

}  // namespace gpipe::detail
