// check.h — argument checks whose error is the message alone: no C++ backtrace in what().
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

// TORCH_CHECK's c10::Error carries the source location and a C++ backtrace
// in what(): right for a bug inside torch, a wall of frames for a user who
// passed a bad balance. A bad argument is the user's to fix, and the message
// (which names the value and the fix) is all they need, so these throw the
// message alone. The types stay c10's, so `catch (const c10::Error&)` still
// catches them and Python still maps c10::ValueError to ValueError and
// c10::IndexError to IndexError (torch's pybind11 translator).
//
//   GPIPE_CHECK_VALUE(total == layers, "balance ", ..., " sums to ", total, ...);
//
// GPIPE_CHECK_VALUE: a value is wrong (Python ValueError).
// GPIPE_CHECK_INDEX: an index or a count is out of range (Python IndexError).
#define GPIPE_CHECK_VALUE(cond, ...)                                   \
  do {                                                                 \
    if (C10_UNLIKELY(!(cond))) {                                       \
      ::gpipe::detail::throw_value_error(::c10::str(__VA_ARGS__));     \
    }                                                                  \
  } while (false)

#define GPIPE_CHECK_INDEX(cond, ...)                                   \
  do {                                                                 \
    if (C10_UNLIKELY(!(cond))) {                                       \
      ::gpipe::detail::throw_index_error(::c10::str(__VA_ARGS__));     \
    }                                                                  \
  } while (false)

namespace gpipe::detail {

/// Throws c10::ValueError whose what() is `message`, nothing more.
[[noreturn]] void throw_value_error(std::string message);
/// Throws c10::IndexError whose what() is `message`, nothing more.
[[noreturn]] void throw_index_error(std::string message);

/// "1 layer", "2 layers", "0 layers": a count with its noun, for messages.
std::string count(int64_t n, const char* noun);

/// The first line of an error (a Python error's what() goes on with its
/// traceback): what the other ranks are told.
std::string first_line(const std::string& text);

namespace listing {
template <typename T>
void put(std::ostream& out, const T& value) {
  out << value;
}
template <typename T>
void put(std::ostream& out, const std::optional<T>& value) {
  if (value) {
    out << *value;
  } else {
    out << "None";
  }
}
}  // namespace listing

/// "[2, 3, 2]": values as a list, for messages (an empty optional reads None).
template <typename T>
std::string listed(const std::vector<T>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t k = 0; k < values.size(); ++k) {
    out << (k ? ", " : "");
    listing::put(out, values[k]);
  }
  out << "]";
  return out.str();
}

/// A class name without its namespaces ("Down" for "unet::(anonymous
/// namespace)::Down"), for messages.
std::string short_name(const std::string& type_name);

}  // namespace gpipe::detail
