// transport_wire.h — what the process-group transport's two matching modes share: the header message's layout, failure headers, giving up posted receives.
//
// The transport (transport_c10d.h) is one class over three files: the
// shared mechanics (transport_c10d.cpp: sends, waits, the reaper, failure),
// the tagged matching (transport_tagged.cpp, Gloo) and the ordered one
// (transport_ordered.cpp, NCCL). This header is theirs alone.
#pragma once

#include "transport.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <c10/util/StringUtil.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail::wire {

// The fixed header message: [kind, length, up to kWireInts - 2 integers];
// a longer header (a batch of many values) sends the rest in a second
// message on the same tag.
inline constexpr int64_t kWireInts = 64;
inline constexpr int64_t kWireBody = kWireInts - 2;
inline constexpr int64_t kBatch = 0;
inline constexpr int64_t kFailure = 1;
// Tagged mode: a batch whose values travel inside the header, after its
// metadata ([meta length, meta ..., the values' bytes]; see transport_tagged.cpp).
inline constexpr int64_t kInline = 2;
// Tag parts: the header, the tensors as the receiver expects them, the
// tensors after a change of shapes.
inline constexpr int kHeaderPart = 0;
inline constexpr int kExpectedPart = 1;
inline constexpr int kChangedPart = 2;
// How many receives ahead the tensors' receives are posted: the memory of
// that many hand-offs, received before their turn.
inline constexpr size_t kEarlyWindow = 8;
// A failure header's text is cut to what fits in one message.
inline constexpr size_t kFailureChars = static_cast<size_t>(kWireBody - 1) * sizeof(int64_t);

/// A failure header's integers: the origin rank, then its message (cut to
/// kFailureChars), and back.
std::vector<int64_t> pack(int64_t origin, const std::string& text);
std::pair<int64_t, std::string> unpack(const std::vector<int64_t>& ints);
/// "activations", "grads", "skip", "skip grad".
const char* flow_name(Flow flow);
/// A header message (kind, length, the first kWireBody integers) and, for a
/// longer one, the rest of the integers (undefined when none).
std::pair<at::Tensor, at::Tensor> wire_parts(const std::vector<int64_t>& ints, int64_t kind);

// A failure between ranks: the message names the ranks; a C++ backtrace of
// this rank would only hide that.
template <typename... Args>
[[noreturn]] void fail_between_ranks(const Args&... args) {
  throw c10::Error(c10::str(args...), /*backtrace=*/nullptr);
}

// Receives given up on (a cancel, a lost peer) may still be matched by a
// late message: on the way out, `drop` (which aborts where that is safe,
// then buries) gets whatever was not waited for (a waited one has its work
// reset).
template <typename Pendings, typename Drop>
auto unwaited(Pendings& pending, Drop drop) {
  return c10::make_scope_exit([&pending, drop] {
    for (auto& p : pending) {
      if (p.work) drop(std::move(p));
    }
  });
}

}  // namespace gpipe::detail::wire
