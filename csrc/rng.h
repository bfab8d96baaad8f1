// rng.h — the default generators a cell draws from: their locks, saved states and per-cell streams.
//
// RNG rule (docs/design.md, "The RNG rule"). A checkpointed cell must draw in
// its recompute what it drew in its first forward, and a seeded run must draw
// the same numbers whatever the threads' timing. Stages on different workers
// that share a default generator (every CPU stage; several stages on one
// GPU) would otherwise draw from it in whatever order the threads come.
//
// - With more than one micro-batch, a generator shared by several workers is
//   given, for each cell that may draw from it, a state of its own: seeded
//   from (a seed drawn once per step from the caller's generator, the stage,
//   the micro-batch), set for the cell under the generator's exclusive lock
//   and replaced by the live state after it. So the numbers a cell draws do
//   not depend on any other cell, and the caller's generator advances by one
//   draw per step.
// - Otherwise (one micro-batch: the cells run one after the other, in the
//   plain model's order; or a generator only one worker draws from, in its
//   fixed order) cells draw from the live generator, and a checkpointed cell
//   snapshots its state before its forward.
//
// Either way a recompute replays the state its cell started from, under the
// exclusive lock. We never hold the generator's own mutex across a cell: the
// random ops take that one themselves.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace gpipe::detail {

/// The default generators a stage on `device` may draw from: the CPU's, then
/// (for an accelerator) the device's own. Always in this order, which is
/// also the locking order.
std::vector<at::Generator> generators_for(c10::Device device);

/// A reader-writer lock on which a waiting writer holds off new readers
/// (std::shared_mutex is glibc's reader-preferring rwlock). A cell that needs
/// a generator to itself (its stream set, or a snapshot) then goes before a
/// busy stage's next cell, in the order the cells came: the stages that hold
/// it shared do not starve it, and a failure it meets is known before their
/// next cell starts (cancel.h). Meets Lockable and SharedLockable; no
/// recursion (no cell waits for a lock while holding one of the same).
class GeneratorLock {
 public:
  void lock();
  void unlock();
  void lock_shared();
  void unlock_shared();

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t readers_ = 0;
  int64_t writers_waiting_ = 0;
  bool writer_ = false;
};

/// The process-wide lock of `generator` (one per generator, never destroyed).
GeneratorLock& lock_for(const at::Generator& generator);

/// The generator's state, read under its own mutex.
at::Tensor get_state(const at::Generator& generator);
/// Sets the generator's state under its own mutex.
void set_state(at::Generator& generator, const at::Tensor& state);
/// Whether two states from `get_state` are byte for byte equal.
bool same_state(const at::Tensor& a, const at::Tensor& b);

/// A generator's state, kept to tell later whether it drew meanwhile: the
/// CPU generator's engine and cached normal samples, copied in place (a
/// cell's forward takes two of these, and `get_state` would allocate and
/// serialize 5 KB each time); any other generator's `get_state`. Equal
/// exactly when the states `get_state` would return are equal. Read under
/// the generator's own mutex.
class DrawMark {
 public:
  explicit DrawMark(const at::Generator& generator);
  bool operator==(const DrawMark& other) const;

 private:
  std::optional<at::mt19937> engine_;
  std::optional<float> float_normal_;
  std::optional<double> double_normal_;
  at::Tensor state_;
};

/// A step's seed for the cells' own streams: one 64-bit draw from the
/// default CPU generator (the caller's), taken under its exclusive lock so
/// that no cell's state is set on it meanwhile.
uint64_t draw_step_seed();
/// The seed of the stream cell (`stage`, `microbatch`) draws from on its
/// stage's generator number `generator` in a step seeded `step_seed`.
uint64_t cell_seed(uint64_t step_seed, int64_t stage, int64_t microbatch, size_t generator);
/// Puts `generator` in the state a fresh generator seeded `seed` starts in
/// (under its own mutex).
void reseed(at::Generator& generator, uint64_t seed);

}  // namespace gpipe::detail
