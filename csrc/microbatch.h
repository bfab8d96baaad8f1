// microbatch.h — cutting a batch into micro-batches along each value's batch dimension and gathering them back.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
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

/// Where each value's batch dimension lies (negative: counted from the
/// end), or `std::nullopt`: the value is not cut, every micro-batch gets all
/// of it. One entry serves every value; otherwise one entry per value.
using BatchDims = std::vector<std::optional<int64_t>>;

/// How one value was cut: along `dim` into pieces of `sizes` (one per
/// micro-batch), or not at all (`dim` empty: shared by every micro-batch on
/// the way in, taken from micro-batch 0 on the way out).
struct ValueCut {
  std::optional<int64_t> dim;
  std::vector<int64_t> sizes;
};

/// A batch cut into micro-batches, and how each value was cut.
struct Scattered {
  std::vector<Batch> microbatches;
  std::vector<ValueCut> cuts;
};

/// The sizes of the micro-batches `rows` rows make: `chunks` pieces whose
/// sizes differ by at most one (the larger first), fewer only when there
/// are fewer rows than chunks (one row each); 0 rows make one empty piece.
/// 17 rows in 16 chunks: 2, then fifteen 1s (`at::chunk` would make 9).
std::vector<int64_t> microbatch_sizes(int64_t rows, int64_t chunks);

/// Cuts `batch` into micro-batches: each value along its dim in `dims`, all
/// cut values into the same sizes (see `microbatch_sizes`), so they must
/// agree on the rows there. With chunks == 1, or a 0-dimensional value and
/// chunks == 1, nothing is cut and the batch is its only micro-batch.
/// `what` names the batch in errors ("input", "target").
Scattered scatter(const Batch& batch, int64_t chunks, const BatchDims& dims = {0},
                  const char* what = "input");

/// Joins the micro-batches' outputs, value by value: along its dim in
/// `dims` (each value keeps its own sizes, so outputs may have other row
/// counts than the input), or, where `dims` says not cut, micro-batch 0's.
/// A single micro-batch comes back as it is. `cuts`, when given, receives
/// how each output value was joined, to cut its grad alike.
Batch gather(const std::vector<Batch>& microbatches, const BatchDims& dims = {0},
             std::vector<ValueCut>* cuts = nullptr);

/// Cuts a grad of the value cut as `cut` into one piece per micro-batch
/// (micro-batch 0 gets a not-cut value's whole grad, the others none).
std::vector<at::Tensor> cut_grad(const at::Tensor& grad, const ValueCut& cut, int64_t microbatches);

/// Joins per-micro-batch grads of the value cut as `cut`: concatenated along
/// its dim, with zeros where a micro-batch got none; summed where the value
/// was shared. Undefined when no micro-batch got a grad.
at::Tensor join_grads(const std::vector<at::Tensor>& parts, const ValueCut& cut);

}  // namespace gpipe::detail
