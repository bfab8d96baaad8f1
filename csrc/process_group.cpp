// process_group.cpp — init_process_group: a c10d ProcessGroup with a Gloo or NCCL backend, made as Python's init_process_group makes one.
//
// CMake compiles this file with GPIPE_WITH_GLOO (and USE_C10D_GLOO) only where
// Gloo's headers are found and torch's ProcessGroupGloo.hpp compiles against
// them, and with GPIPE_WITH_NCCL only for a CUDA torch with nccl.h: torch's
// wheel ships neither Gloo's headers nor a C++ way to make a group without
// them, so this is what lets a LibTorch program with no Python run a
// DistributedPipe. Only gpipe's own build needs those headers; the public
// header includes none of them.
//
// The backend's class layout reaches gloo only through smart pointers, and
// every gloo call is inside libtorch, so Debian's libgloo-dev (an older gloo
// than torch's own) serves for the declarations: CMake's check compiles and
// links a backend's construction, and tests/cpp's two-process test trains
// over it.
#include <gpipe/process_group.h>

#include "check.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef GPIPE_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef GPIPE_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

namespace gpipe::distributed {
namespace {

/// `text` as a whole decimal integer, or nothing.
std::optional<long long> integer(const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0') return std::nullopt;
  return value;
}

/// `$name` as an integer, or `given` where that is not -1.
int64_t from_env(int64_t given, const char* name, const char* field) {
  if (given != -1) return given;
  const char* text = std::getenv(name);
  GPIPE_CHECK_VALUE(text != nullptr && *text != '\0', "init_process_group: ", field,
                    " is -1 (read $", name, ") but $", name, " is not set; pass ProcessGroupOptions()."
                    , field, "(...) or launch with torchrun, which sets it");
  const auto value = integer(text);
  GPIPE_CHECK_VALUE(value.has_value(), "init_process_group: $", name, " is \"", text,
                    "\", not an integer; set it to this process's ", field);
  return *value;
}

/// torchrun's rendezvous as Python's env:// makes it: a TCPStore at
/// $MASTER_ADDR:$MASTER_PORT, served by rank 0 unless torchrun's agent serves it.
c10::intrusive_ptr<c10d::Store> env_store(int64_t rank, int64_t world_size,
                                          std::chrono::milliseconds timeout) {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  GPIPE_CHECK_VALUE(addr != nullptr && *addr != '\0' && port != nullptr && *port != '\0',
                    "init_process_group: no store given and $MASTER_ADDR / $MASTER_PORT are not "
                    "set (MASTER_ADDR=", addr ? addr : "<unset>", ", MASTER_PORT=",
                    port ? port : "<unset>", "); pass ProcessGroupOptions().store(...) (e.g. a "
                    "c10d::TCPStore or FileStore) or launch with torchrun, which sets them");
  const auto number = integer(port);
  GPIPE_CHECK_VALUE(number && *number > 0 && *number <= std::numeric_limits<uint16_t>::max(),
                    "init_process_group: $MASTER_PORT is \"", port,
                    "\", not a port number (1 to 65535)");
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(*number);
  options.isServer = rank == 0 && !(agent != nullptr && std::string(agent) == "True");
  options.numWorkers = static_cast<size_t>(world_size);
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(addr, options);
}

/// The backend of `name` for the group's ranks at `store`.
c10::intrusive_ptr<c10d::Backend> make_backend(const std::string& name,
                                               const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size,
                                               std::chrono::milliseconds timeout) {
#ifdef GPIPE_WITH_GLOO
  if (name == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  }
#endif
#ifdef GPIPE_WITH_NCCL
  if (name == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  }
#endif
  (void)store, (void)rank, (void)size, (void)timeout;
  GPIPE_CHECK_VALUE(false, "init_process_group: this build of gpipe cannot make a \"", name,
                    "\" group: ", name == "gloo"
                        ? "it was built without Gloo's headers (install Debian's libgloo-dev and "
                          "rebuild gpipe: CMake's configure step says whether they match torch's "
                          "ProcessGroupGloo.hpp)"
                        : "it was built without NCCL (a CUDA build of torch and nccl.h, from "
                          "torch's nvidia-nccl wheel, are needed when gpipe is built)",
                    "; or make the group in Python (torch.distributed) and pass it to C++");
  return {};
}

}  // namespace

bool has_backend(const std::string& backend) {
#ifdef GPIPE_WITH_GLOO
  if (backend == "gloo") return true;
#endif
#ifdef GPIPE_WITH_NCCL
  if (backend == "nccl") return true;
#endif
  return false;
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options) {
  const std::string& backend = options.backend();
  GPIPE_CHECK_VALUE(backend == "gloo" || backend == "nccl", "init_process_group: backend is \"",
                    backend, "\"; pass \"gloo\" (CPU tensors) or \"nccl\" (CUDA tensors)");
  const int64_t world_size = from_env(options.world_size(), "WORLD_SIZE", "world_size");
  const int64_t rank = from_env(options.rank(), "RANK", "rank");
  GPIPE_CHECK_VALUE(world_size >= 1 && world_size <= std::numeric_limits<int>::max(),
                    "init_process_group: world_size is ", world_size, "; pass at least 1");
  GPIPE_CHECK_VALUE(rank >= 0 && rank < world_size, "init_process_group: rank is ", rank,
                    " but world_size is ", world_size, "; pass a rank from 0 to ", world_size - 1);
  GPIPE_CHECK_VALUE(options.timeout().count() > 0, "init_process_group: timeout is ",
                    options.timeout().count(), " ms; pass a positive duration");
  auto store = options.store() ? options.store()
                               : env_store(rank, world_size, options.timeout());
  // The n-th call of every process forms one group unless named: its keys
  // live under its name, as Python's groups' do, so groups on one store never
  // meet.
  static std::atomic<int64_t> made{0};
  const int64_t n = made++;
  const std::string name =
      options.group_name().empty() ? "gpipe_" + std::to_string(n) : options.group_name();
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name + "/", store);
  const int r = static_cast<int>(rank);
  const int size = static_cast<int>(world_size);
  auto backend_impl = make_backend(backend, prefixed, r, size, options.timeout());
  auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, r, size);
  const auto type = backend == "gloo" ? c10d::ProcessGroup::BackendType::GLOO
                                      : c10d::ProcessGroup::BackendType::NCCL;
  group->setBackend(backend == "gloo" ? c10::DeviceType::CPU : c10::DeviceType::CUDA, type,
                    backend_impl);
  group->setDefaultBackend(type);
  group->setGroupName(name);
  return group;
}

}  // namespace gpipe::distributed
