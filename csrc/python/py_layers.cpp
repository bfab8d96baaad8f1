// py_layers.cpp — calling a stage's Python modules, converting tensors and tuples both ways.
#include "py_layers.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace gpipe::python {

namespace {

[[noreturn]] void raise_type_error(const std::string& message) {
  PyErr_SetString(PyExc_TypeError, message.c_str());
  throw py::error_already_set();
}

// Appends the training flags of `module` and of every module under it, in
// the order `module.modules()` gives them (each once), walking `_modules`
// directly: that generator costs ~1 us per module (its memo, its names),
// and this runs at every step's start for every stage. A module whose
// `_modules` is not a dict (a ScriptModule's) is walked by `modules()`.
void add_training_flags(py::handle module, std::vector<bool>& flags,
                        std::unordered_set<PyObject*>& seen) {
  if (!seen.insert(module.ptr()).second || !py::hasattr(module, "training")) return;
  const py::object children = py::getattr(module, "_modules", py::none());
  if (!py::isinstance<py::dict>(children)) {
    if (!py::hasattr(module, "modules")) {
      flags.push_back(py::bool_(module.attr("training")));
      return;
    }
    for (auto m : module.attr("modules")()) {
      if (m.ptr() == module.ptr() || seen.insert(m.ptr()).second) {
        flags.push_back(py::bool_(m.attr("training")));
      }
    }
    return;
  }
  flags.push_back(py::bool_(module.attr("training")));
  for (auto item : py::reinterpret_borrow<py::dict>(children)) {
    if (!item.second.is_none()) add_training_flags(item.second, flags, seen);
  }
}

}  // namespace

detail::Batch to_batch(py::handle value, const char* what) {
  if (THPVariable_Check(value.ptr())) return detail::Batch(THPVariable_Unpack(value.ptr()));
  if (py::isinstance<py::tuple>(value)) {
    auto tuple = py::reinterpret_borrow<py::tuple>(value);
    std::vector<at::Tensor> tensors;
    tensors.reserve(tuple.size());
    for (size_t i = 0; i < tuple.size(); ++i) {
      if (!THPVariable_Check(tuple[i].ptr())) {
        raise_type_error(std::string("expected Tensor or Tuple[Tensor, ...] as ") + what +
                         ", but element " + std::to_string(i) + " of the tuple is " +
                         std::string(py::str(py::type::of(tuple[i]).attr("__name__"))));
      }
      tensors.push_back(THPVariable_Unpack(tuple[i].ptr()));
    }
    return detail::Batch(std::move(tensors), /*is_atomic=*/false);
  }
  raise_type_error(std::string("expected Tensor or Tuple[Tensor, ...] as ") + what + ", but got " +
                   std::string(py::str(py::type::of(value).attr("__name__"))));
}

py::object to_python(const detail::Batch& batch) {
  if (batch.atomic) return py::reinterpret_steal<py::object>(THPVariable_Wrap(batch[0]));
  py::tuple out(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(batch[i]));
  }
  return std::move(out);
}

PyLayers::PyLayers(py::object layers, int64_t stage, size_t arriving, size_t leaving)
    : layers_(std::move(layers)),
      stage_(stage),
      runner_(!py::isinstance<py::list>(layers_)),
      arriving_(arriving),
      leaving_(leaving) {}

PyLayers::~PyLayers() {
  // The last owner may be an autograd thread without the GIL.
  if (!Py_IsInitialized()) {
    (void)layers_.release();  // the interpreter is gone; leak rather than crash
    return;
  }
  py::gil_scoped_acquire gil;
  // Drop the reference here, under the GIL; layers_ is left empty, so its own
  // destructor (which runs after this scope) touches no Python object.
  layers_.release().dec_ref();
}

std::vector<bool> PyLayers::training_flags() const {
  py::gil_scoped_acquire gil;
  std::vector<bool> flags;
  py::list layers;
  if (!runner_) {
    layers = layers_;
  } else if (py::hasattr(layers_, "layers")) {
    layers = py::list(layers_.attr("layers"));
  } else {
    layers.append(layers_);
  }
  std::unordered_set<PyObject*> seen;
  for (auto layer : layers) add_training_flags(layer, flags, seen);
  return flags;
}

detail::Batch PyLayers::forward(const detail::Batch& input) {
  py::gil_scoped_acquire gil;
  if (runner_) return run_with_skips(input);
  py::object x = to_python(input);
  for (auto layer : layers_) x = layer(x);
  const std::string what = "the output of stage " + std::to_string(stage_);
  return to_batch(x, what.c_str());
}

detail::Batch PyLayers::run_with_skips(const detail::Batch& input) {
  // The input's main values, then the arriving skips; the output likewise.
  TORCH_INTERNAL_ASSERT(input.size() >= arriving_);
  const size_t main = input.size() - arriving_;
  detail::Batch main_input(
      std::vector<at::Tensor>(input.values.begin(),
                              input.values.begin() + static_cast<std::ptrdiff_t>(main)),
      input.atomic);
  py::tuple skips(arriving_);
  for (size_t k = 0; k < arriving_; ++k) {
    skips[k] = py::reinterpret_steal<py::object>(THPVariable_Wrap(input[main + k]));
  }
  py::object result = layers_(to_python(main_input), skips);
  const std::string what = "the output of stage " + std::to_string(stage_);
  TORCH_INTERNAL_ASSERT(py::isinstance<py::tuple>(result) && py::len(result) == 2);
  auto pair = py::reinterpret_borrow<py::tuple>(result);
  detail::Batch out = to_batch(pair[0], what.c_str());
  auto leaving = py::reinterpret_borrow<py::tuple>(pair[1]);
  TORCH_INTERNAL_ASSERT(leaving.size() == leaving_);
  for (size_t k = 0; k < leaving_; ++k) {
    // A skip stashed as None travels as an undefined tensor.
    out.values.push_back(leaving[k].is_none() ? at::Tensor() : THPVariable_Unpack(leaving[k].ptr()));
  }
  return out;
}

}  // namespace gpipe::python
