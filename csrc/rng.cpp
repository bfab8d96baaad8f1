// rng.cpp — default generators per device, their locks and their states.
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

std::shared_mutex& lock_for(const at::Generator& generator) {
  // Default generators live for the whole process, so their impl pointers
  // are stable keys. The map only grows (one entry per device).
  static std::mutex registry_mutex;
  static std::map<const void*, std::unique_ptr<std::shared_mutex>> registry;
  std::lock_guard<std::mutex> hold(registry_mutex);
  auto& slot = registry[generator.unsafeGetGeneratorImpl()];
  if (!slot) slot = std::make_unique<std::shared_mutex>();
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

}  // namespace gpipe::detail
