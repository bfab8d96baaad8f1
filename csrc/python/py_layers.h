// py_layers.h — one stage of Python modules, called from a worker thread under the GIL.
#pragma once

#include "../stage.h"

#include <pybind11/pybind11.h>

namespace gpipe::python {

/// Runs a list of Python modules in order. Holds the GIL only while calling
/// into Python; the torch ops those modules run release it, so stages on
/// different workers overlap.
class PyLayers : public detail::Layers {
 public:
  PyLayers(pybind11::list layers, int64_t stage);
  ~PyLayers() override;

  detail::Batch forward(const detail::Batch& input) override;

 private:
  pybind11::list layers_;
  int64_t stage_;
};

/// A tensor, or a tuple of tensors, as a Batch; raises TypeError otherwise.
detail::Batch to_batch(pybind11::handle value, const char* what);
/// A Batch as a tensor (atomic) or a tuple of tensors.
pybind11::object to_python(const detail::Batch& batch);

}  // namespace gpipe::python
