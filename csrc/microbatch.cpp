// microbatch.cpp — scatter along dim 0 like at::chunk, gather by concatenation.
#include "microbatch.h"

#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>

namespace gpipe::detail {

std::vector<Batch> scatter(const Batch& batch, int64_t chunks) {
  TORCH_CHECK(chunks >= 1, "chunks must be at least 1, got ", chunks);
  TORCH_CHECK(!batch.values.empty(), "the Pipe got no input tensors; pass at least one");
  int64_t rows = -1;
  for (size_t k = 0; k < batch.size(); ++k) {
    const auto& t = batch[k];
    TORCH_CHECK(t.defined(), "input ", k, " is an undefined tensor");
    TORCH_CHECK(t.dim() >= 1, "input ", k,
                " is 0-dimensional; the Pipe cuts inputs into micro-batches along dim 0, so each "
                "needs a batch dimension");
    if (rows < 0) rows = t.size(0);
    TORCH_CHECK(t.size(0) == rows, "input ", k, " has ", t.size(0), " rows but input 0 has ", rows,
                "; all inputs must share the batch dimension (dim 0)");
  }
  if (chunks == 1) return {batch};
  TORCH_CHECK(rows > 0, "the batch is empty (0 rows); give the Pipe at least one row");

  std::vector<std::vector<at::Tensor>> pieces;
  for (const auto& t : batch.values) pieces.push_back(t.chunk(chunks, 0));
  const size_t n = pieces.front().size();
  std::vector<Batch> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i].atomic = batch.atomic;
    for (auto& p : pieces) out[i].values.push_back(std::move(p[i]));
  }
  return out;
}

Batch gather(const std::vector<Batch>& microbatches) {
  TORCH_INTERNAL_ASSERT(!microbatches.empty());
  if (microbatches.size() == 1) return microbatches.front();
  const auto& first = microbatches.front();
  Batch out;
  out.atomic = first.atomic;
  for (size_t k = 0; k < first.size(); ++k) {
    std::vector<at::Tensor> parts;
    parts.reserve(microbatches.size());
    for (size_t i = 0; i < microbatches.size(); ++i) {
      const auto& mb = microbatches[i];
      TORCH_CHECK(mb.size() == first.size(), "micro-batch ", i, " produced ", mb.size(),
                  " outputs but micro-batch 0 produced ", first.size());
      const auto& t = mb[k];
      TORCH_CHECK(t.defined() && t.dim() >= 1, "output ", k, " of micro-batch ", i,
                  " has no batch dimension (", (t.defined() ? "0-dimensional" : "undefined"),
                  "); with chunks > 1 the Pipe concatenates outputs along dim 0, so each output "
                  "needs one");
      parts.push_back(t);
    }
    out.values.push_back(at::cat(parts, 0));
  }
  return out;
}

std::vector<int64_t> rows_of(const std::vector<Batch>& microbatches) {
  std::vector<int64_t> rows;
  rows.reserve(microbatches.size());
  for (const auto& mb : microbatches) rows.push_back(mb.values.front().size(0));
  return rows;
}

}  // namespace gpipe::detail
