// phase.h — whether the calling layer runs in a checkpointed first forward or in a recompute.
#pragma once

namespace gpipe {

/// True while a layer runs in the first forward of a checkpointed cell (no
/// graph kept; it will be recomputed before its backward).
bool is_checkpointing() noexcept;

/// True while a layer runs in the recompute of a checkpointed cell, just
/// before that cell's backward. Layers that keep statistics (batch norm) can
/// use it not to count a micro-batch twice.
bool is_recomputing() noexcept;

}  // namespace gpipe
