// rng.cpp — default generators per device, their locks, their states and the cells' seeds.
#include "rng.h"

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace gpipe::detail {

std::vector<at::Generator> generators_for(c10::Device device) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (!device.is_cpu()) {
    gens.push_back(at::globalContext().defaultGenerator(device));
  }
  return gens;
}

void GeneratorLock::lock() {
  std::unique_lock<std::mutex> hold(mutex_);
  ++writers_waiting_;
  changed_.wait(hold, [&] { return !writer_ && readers_ == 0; });
  --writers_waiting_;
  writer_ = true;
}

void GeneratorLock::unlock() {
  {
    std::lock_guard<std::mutex> hold(mutex_);
    writer_ = false;
  }
  changed_.notify_all();
}

void GeneratorLock::lock_shared() {
  std::unique_lock<std::mutex> hold(mutex_);
  changed_.wait(hold, [&] { return !writer_ && writers_waiting_ == 0; });
  ++readers_;
}

void GeneratorLock::unlock_shared() {
  bool last = false;
  {
    std::lock_guard<std::mutex> hold(mutex_);
    last = --readers_ == 0;
  }
  if (last) changed_.notify_all();
}

GeneratorLock& lock_for(const at::Generator& generator) {
  // Default generators live for the whole process, so their impl pointers
  // are stable keys. The map only grows (one entry per device).
  static std::mutex registry_mutex;
  static std::map<const void*, std::unique_ptr<GeneratorLock>> registry;
  std::lock_guard<std::mutex> hold(registry_mutex);
  auto& slot = registry[generator.unsafeGetGeneratorImpl()];
  if (!slot) slot = std::make_unique<GeneratorLock>();
  return *slot;
}

at::Tensor get_state(const at::Generator& generator) {
  at::Generator g = generator;  // shares the impl; mutex() is not const
  std::lock_guard<std::mutex> hold(g.mutex());
  return g.get_state();
}

void set_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> hold(generator.mutex());
  generator.set_state(state);
}

bool same_state(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == b.numel() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0;
}

DrawMark::DrawMark(const at::Generator& generator) {
  at::Generator g = generator;  // shares the impl; mutex() is not const
  std::lock_guard<std::mutex> hold(g.mutex());
  if (auto* cpu = dynamic_cast<at::CPUGeneratorImpl*>(g.unsafeGetGeneratorImpl())) {
    engine_.emplace(cpu->engine());
    float_normal_ = cpu->next_float_normal_sample();
    double_normal_ = cpu->next_double_normal_sample();
  } else {
    state_ = g.get_state();
  }
}

bool DrawMark::operator==(const DrawMark& other) const {
  if (engine_.has_value() != other.engine_.has_value()) return false;
  if (!engine_) return same_state(state_, other.state_);
  // Field by field: the pod has padding, which memcmp would compare too.
  const auto a = engine_->data();
  const auto b = other.engine_->data();
  return a.seed_ == b.seed_ && a.left_ == b.left_ && a.seeded_ == b.seeded_ &&
         a.next_ == b.next_ && a.state_ == b.state_ && float_normal_ == other.float_normal_ &&
         double_normal_ == other.double_normal_;
}

uint64_t draw_step_seed() {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  std::unique_lock<GeneratorLock> exclusive(lock_for(cpu));
  std::lock_guard<std::mutex> hold(cpu.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(cpu)->random64();
}

namespace {

// SplitMix64's finalizer: every input bit reaches every output bit, so
// neighbouring (stage, micro-batch) pairs get unrelated seeds.
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t cell_seed(uint64_t step_seed, int64_t stage, int64_t microbatch, size_t generator) {
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
  uint64_t h = mix(step_seed + kGolden);
  h = mix(h ^ (static_cast<uint64_t>(stage) + 1) * kGolden);
  h = mix(h ^ (static_cast<uint64_t>(microbatch) + 1) * kGolden);
  return mix(h ^ (static_cast<uint64_t>(generator) + 1) * kGolden);
}

void reseed(at::Generator& generator, uint64_t seed) {
  std::lock_guard<std::mutex> hold(generator.mutex());
  generator.set_current_seed(seed);
}

}  // namespace gpipe::detail
