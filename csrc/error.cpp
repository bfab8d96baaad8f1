// error.cpp — CellError: the layer's message, prefixed with where it happened.
#include <gpipe/error.h>

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

}  // namespace gpipe
