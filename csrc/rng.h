// rng.h — saving and replaying the default generators a checkpointed cell draws from.
//
// RNG rule: stages sharing a generator (every CPU stage; several
// stages on one GPU) draw from it concurrently. A checkpointed cell whose
// stage draws, and every recompute that replays draws, therefore hold
// `lock_for(generator)` exclusively, so no other cell draws between the
// snapshot and the cell's own draws; every other cell of a run with
// checkpoints holds it shared. A checkpointed cell of a stage that has not
// drawn so far holds it shared and checks the state after its forward (see
// Stage::forward for what it does when the state moved). We never hold the
// generator's own mutex across a cell: the random ops take that one
// themselves.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <shared_mutex>
#include <vector>

namespace gpipe::detail {

/// The default generators a stage on `device` may draw from: the CPU's, then
/// (for an accelerator) the device's own. Always in this order, which is
/// also the locking order.
std::vector<at::Generator> generators_for(c10::Device device);

/// The process-wide lock of `generator` (one per generator, never destroyed).
std::shared_mutex& lock_for(const at::Generator& generator);

/// The generator's state, read under its own mutex.
at::Tensor get_state(const at::Generator& generator);
/// Sets the generator's state under its own mutex.
void set_state(at::Generator& generator, const at::Tensor& state);
/// Whether two states from `get_state` are byte for byte equal.
bool same_state(const at::Tensor& a, const at::Tensor& b);

}  // namespace gpipe::detail
