// phase.cpp — the thread-local flag behind is_checkpointing / is_recomputing.
#include "phase.h"

#include <gpipe/phase.h>

namespace gpipe {

namespace {
thread_local detail::Running current = detail::Running::Plain;
}  // namespace

bool is_checkpointing() noexcept { return current == detail::Running::Checkpointing; }
bool is_recomputing() noexcept { return current == detail::Running::Recomputing; }

namespace detail {

RunningGuard::RunningGuard(Running running) : previous_(current) { current = running; }
RunningGuard::~RunningGuard() { current = previous_; }

}  // namespace detail

}  // namespace gpipe
