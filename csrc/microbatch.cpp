// microbatch.cpp — scatter along each value's batch dim into near-equal pieces, gather by concatenation, grads alike.
#include "microbatch.h"

#include <string>

#include "check.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace gpipe::detail {

namespace {

// The entry of `dims` for value `v` of `count` (one entry serves them all).
std::optional<int64_t> entry(const BatchDims& dims, size_t v, size_t count, const char* values,
                             const char* option) {
  GPIPE_CHECK_VALUE(dims.size() == 1 || dims.size() == count, option, " has ", dims.size(),
                    " entries but the ", values, " has ", count,
                    " values; give one entry per value, or a single entry for all of them");
  return dims.size() == 1 ? dims.front() : dims[v];
}

// `dim` as an index into `t`'s dimensions (a negative one counts from the end).
int64_t resolved(int64_t dim, const at::Tensor& t, const char* option, const char* what,
                 size_t v) {
  const int64_t n = t.dim();
  GPIPE_CHECK_INDEX(dim >= -n && dim < n, option, " ", dim, " is out of range for ", what, " ", v,
                    " of shape ", t.sizes(), " (", n, " dimensions); give a dim in [", -n, ", ", n,
                    ") for it, or None (std::nullopt) to not cut it");
  return dim < 0 ? dim + n : dim;
}

}  // namespace

std::vector<int64_t> microbatch_sizes(int64_t rows, int64_t chunks) {
  GPIPE_CHECK_VALUE(chunks >= 1, "chunks must be at least 1, got ", chunks);
  if (rows <= 0) return {0};
  const int64_t n = std::min(rows, chunks);
  std::vector<int64_t> sizes(static_cast<size_t>(n), rows / n);
  for (int64_t i = 0; i < rows % n; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

Scattered scatter(const Batch& batch, int64_t chunks, const BatchDims& dims, const char* what) {
  GPIPE_CHECK_VALUE(chunks >= 1, "chunks must be at least 1, got ", chunks);
  const bool input = std::string(what) == "input";
  GPIPE_CHECK_VALUE(!batch.values.empty(), "the Pipe got no ", what, " tensors; pass at least one");
  Scattered out;
  out.cuts.resize(batch.size());
  int64_t rows = -1;
  size_t first = 0;
  for (size_t v = 0; v < batch.size(); ++v) {
    const auto& t = batch[v];
    GPIPE_CHECK_VALUE(t.defined(), what, " ", v, " is an undefined tensor");
    const auto dim = entry(dims, v, batch.size(), what, "batch_dim");
    if (!dim) continue;  // shared by every micro-batch
    if (t.dim() == 0) {
      GPIPE_CHECK_VALUE(chunks == 1, what, " ", v, " is 0-dimensional, so it has no batch "
                        "dimension to cut into ", chunks, " micro-batches; ",
                        input ? "mark it not cut (batch_dim entry None, std::nullopt in C++) or "
                                "use chunks=1"
                              : "give one target row per input row (targets are cut along dim "
                                "0), or use chunks=1");
      continue;
    }
    const int64_t d = resolved(*dim, t, "batch_dim", what, v);
    out.cuts[v].dim = d;
    if (rows < 0) {
      rows = t.size(d);
      first = v;
    }
    GPIPE_CHECK_VALUE(t.size(d) == rows, what, " ", v, " has ", t.size(d), " rows along dim ", d,
                      " but ", what, " ", first, " has ", rows, " along dim ",
                      *out.cuts[first].dim, "; every cut ", what, " needs the same batch size ",
                      input ? "(see batch_dim)" : "(targets are cut along dim 0, like the input)");
  }
  const auto sizes = rows < 0 ? std::vector<int64_t>{} : microbatch_sizes(rows, chunks);
  for (auto& cut : out.cuts) {
    if (cut.dim) cut.sizes = sizes;
  }
  if (sizes.size() <= 1) {
    out.microbatches.push_back(batch);
    return out;
  }
  out.microbatches.resize(sizes.size());
  for (auto& mb : out.microbatches) mb.atomic = batch.atomic;
  for (size_t v = 0; v < batch.size(); ++v) {
    if (!out.cuts[v].dim) {
      for (auto& mb : out.microbatches) mb.values.push_back(batch[v]);
      continue;
    }
    auto pieces = batch[v].split_with_sizes(sizes, *out.cuts[v].dim);
    for (size_t i = 0; i < pieces.size(); ++i) {
      out.microbatches[i].values.push_back(std::move(pieces[i]));
    }
  }
  return out;
}

Batch gather(const std::vector<Batch>& microbatches, const BatchDims& dims,
             std::vector<ValueCut>* cuts) {
  TORCH_INTERNAL_ASSERT(!microbatches.empty());
  const auto& first = microbatches.front();
  const size_t n = first.size();
  for (size_t i = 1; i < microbatches.size(); ++i) {
    TORCH_CHECK(microbatches[i].size() == n, "micro-batch ", i, " produced ",
                microbatches[i].size(), " outputs but micro-batch 0 produced ", n,
                "; every micro-batch must give the same number of outputs");
  }
  std::vector<ValueCut> joined(n);
  if (microbatches.size() == 1) {
    for (size_t v = 0; v < n; ++v) {
      const auto& t = first[v];
      const auto dim = entry(dims, v, n, "output", "output_batch_dim");
      if (!dim || !t.defined() || t.dim() == 0) continue;
      joined[v].dim = resolved(*dim, t, "output_batch_dim", "output", v);
      joined[v].sizes = {t.size(*joined[v].dim)};
    }
    if (cuts != nullptr) *cuts = std::move(joined);
    return first;
  }
  Batch out;
  out.atomic = first.atomic;
  for (size_t v = 0; v < n; ++v) {
    const auto dim = entry(dims, v, n, "output", "output_batch_dim");
    if (!dim) {
      out.values.push_back(first[v]);
      continue;
    }
    size_t defined = 0;
    for (const auto& mb : microbatches) defined += mb[v].defined() ? 1 : 0;
    if (defined == 0) {
      out.values.emplace_back();
      continue;
    }
    std::vector<at::Tensor> parts;
    parts.reserve(microbatches.size());
    for (size_t i = 0; i < microbatches.size(); ++i) {
      const auto& t = microbatches[i][v];
      TORCH_CHECK(t.defined(), "output ", v, " of micro-batch ", i,
                  " is undefined but other micro-batches gave a tensor there");
      GPIPE_CHECK_VALUE(t.dim() >= 1, "output ", v, " of micro-batch ", i, " is 0-dimensional; "
                        "with several micro-batches the Pipe joins each output along its batch "
                        "dim (output_batch_dim), so it needs one. A per-batch reduction (a loss) "
                        "belongs after the Pipe; otherwise mark the output not joined "
                        "(output_batch_dim entry None: micro-batch 0's value is returned) or use "
                        "chunks=1");
      const int64_t d = resolved(*dim, t, "output_batch_dim", "output", v);
      if (i == 0) joined[v].dim = d;
      joined[v].sizes.push_back(t.size(d));
      parts.push_back(t);
    }
    out.values.push_back(at::cat(parts, *joined[v].dim));
  }
  if (cuts != nullptr) *cuts = std::move(joined);
  return out;
}

std::vector<at::Tensor> cut_grad(const at::Tensor& grad, const ValueCut& cut,
                                 int64_t microbatches) {
  const auto m = static_cast<size_t>(microbatches);
  if (m == 1) return {grad};
  std::vector<at::Tensor> pieces(m);
  if (!grad.defined()) return pieces;
  if (!cut.dim) {
    pieces.front() = grad;
    return pieces;
  }
  TORCH_INTERNAL_ASSERT(cut.sizes.size() == m);
  return grad.split_with_sizes(cut.sizes, *cut.dim);
}

at::Tensor join_grads(const std::vector<at::Tensor>& parts, const ValueCut& cut) {
  const at::Tensor* any = nullptr;
  for (const auto& p : parts) {
    if (p.defined()) any = &p;
  }
  if (any == nullptr) return at::Tensor();
  if (parts.size() == 1) return parts.front();
  if (!cut.dim) {
    // Every micro-batch used all of it: its grad is the sum of theirs.
    at::Tensor sum;
    for (const auto& p : parts) {
      if (p.defined()) sum = sum.defined() ? at::add(sum, p) : p;
    }
    return sum;
  }
  TORCH_INTERNAL_ASSERT(cut.sizes.size() == parts.size());
  std::vector<at::Tensor> filled;
  filled.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].defined()) {
      filled.push_back(parts[i]);
    } else {
      auto sizes = any->sizes().vec();
      sizes[static_cast<size_t>(*cut.dim)] = cut.sizes[i];
      filled.push_back(at::zeros(sizes, any->options()));
    }
  }
  return at::cat(filled, *cut.dim);
}

}  // namespace gpipe::detail
