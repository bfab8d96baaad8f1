// error.h — what gpipe throws: CellError for a failed cell; c10's ValueError/IndexError, message only, for bad arguments.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>

namespace gpipe {

// Bad arguments (a balance that does not sum to the layers, chunks < 1, too
// few devices, ...) throw c10::ValueError, or c10::IndexError for a count or
// an index out of range, when the Pipe is built or the function called. Their
// what() is the message alone, naming the value and the fix, e.g. "balance
// {3, 4} sums to 7 but the Sequential has 8 layers; pass one entry per stage
// summing to 8": no source location, no C++ backtrace. Both derive from
// c10::Error; in Python they are ValueError and IndexError.

/// Raised by `Pipe::forward` and by `backward()` through a Pipe when a layer
/// throws. `what()` reads "gpipe: stage 1, micro-batch 2, backward: <original
/// message>"; `original()` rethrows the exception the layer raised.
class CellError : public c10::Error {
 public:
  CellError(int64_t stage, int64_t microbatch, std::string phase, std::exception_ptr original);

  /// Index of the stage whose layer threw.
  int64_t stage() const noexcept { return stage_; }
  /// Index of the micro-batch it was working on.
  int64_t microbatch() const noexcept { return microbatch_; }
  /// "forward", "backward" or "recompute".
  const std::string& phase() const noexcept { return phase_; }
  /// The exception the layer raised, untouched.
  const std::exception_ptr& original() const noexcept { return original_; }

 private:
  int64_t stage_;
  int64_t microbatch_;
  std::string phase_;
  std::exception_ptr original_;
};

}  // namespace gpipe
