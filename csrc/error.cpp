// error.cpp — gpipe's exceptions: CellError (a layer's message, prefixed with where it happened), bad arguments.
#include <gpipe/error.h>

#include "check.h"

namespace gpipe {

namespace {

std::string describe(const std::exception_ptr& original) {
  try {
    std::rethrow_exception(original);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

}  // namespace

CellError::CellError(int64_t stage, int64_t microbatch, std::string phase,
                     std::exception_ptr original)
    : c10::Error("gpipe: stage " + std::to_string(stage) + ", micro-batch " +
                     std::to_string(microbatch) + ", " + phase + ": " + describe(original),
                 /*backtrace=*/nullptr),
      stage_(stage),
      microbatch_(microbatch),
      phase_(std::move(phase)),
      original_(std::move(original)) {}

namespace detail {

// The base constructor with no backtrace: what() is the message alone (see
// check.h).
void throw_value_error(std::string message) {
  throw c10::ValueError(std::move(message), /*backtrace=*/nullptr);
}

void throw_index_error(std::string message) {
  throw c10::IndexError(std::move(message), /*backtrace=*/nullptr);
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

std::string count(int64_t n, const char* noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string short_name(const std::string& type_name) {
  // After the last "::" outside template arguments and parentheses.
  size_t start = 0;
  int depth = 0;
  for (size_t k = 0; k < type_name.size(); ++k) {
    const char c = type_name[k];
    if (c == '<' || c == '(') ++depth;
    if (c == '>' || c == ')') --depth;
    if (depth == 0 && c == ':' && k + 1 < type_name.size() && type_name[k + 1] == ':') {
      start = k + 2;
    }
  }
  return type_name.substr(start);
}

}  // namespace detail

}  // namespace gpipe
