// error.h — the exception a failed cell raises: the original error, with stage and micro-batch.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>

namespace gpipe {

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
