// py_layers.h — one stage of Python modules, called from a worker thread under the GIL.
#pragma once

#include "../stage.h"

#include <pybind11/pybind11.h>

namespace gpipe::python {

/// Runs a list of Python modules in order, or, for a stage with skip
/// connections, a `gpipe.skip.tracker.StageRunner`: called as
/// `runner(input, skips)` with one tensor (or None) per skip arriving at the
/// stage, it returns `(output, skips)` with one per skip leaving it (see
/// SkipRoute). Holds the GIL only while calling into Python; the torch ops
/// those modules run release it, so stages on different workers overlap.
class PyLayers : public detail::Layers {
 public:
  /// `layers`: a list of modules, or a runner taking `arriving` skips and
  /// giving `leaving` ones.
  PyLayers(pybind11::object layers, int64_t stage, size_t arriving = 0, size_t leaving = 0);
  ~PyLayers() override;

  detail::Batch forward(const detail::Batch& input) override;
  /// The flags of each layer's `modules()` in order (a runner's `layers`).
  std::vector<bool> training_flags() const override;

 private:
  detail::Batch run_with_skips(const detail::Batch& input);

  pybind11::object layers_;
  int64_t stage_;
  bool runner_;
  size_t arriving_;
  size_t leaving_;
};

/// A tensor, or a tuple of tensors, as a Batch; raises TypeError otherwise.
detail::Batch to_batch(pybind11::handle value, const char* what);
/// A Batch as a tensor (atomic) or a tuple of tensors.
pybind11::object to_python(const detail::Batch& batch);

}  // namespace gpipe::python
