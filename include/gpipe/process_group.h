// process_group.h — gpipe::distributed::init_process_group: a c10d process group made from C++, so a program with no Python can run a DistributedPipe.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace gpipe {
namespace distributed {

/// Options of `init_process_group`. Every field left at its default is
/// read from the environment torchrun sets (`RANK`, `WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`), as Python's `init_method="env://"`.
///
/// Example:
/// ```
/// auto group = gpipe::distributed::init_process_group(
///     gpipe::distributed::ProcessGroupOptions().backend("gloo"));
/// gpipe::DistributedPipe pipe(model, gpipe::DistributedPipeOptions({2, 2}).group(group));
/// ```
struct ProcessGroupOptions {
  /// "gloo" (CPU tensors) or "nccl" (CUDA tensors; see `has_backend`).
  TORCH_ARG(std::string, backend) = "gloo";
  /// This process's rank, 0 to world_size - 1; -1: `$RANK`.
  TORCH_ARG(int64_t, rank) = -1;
  /// The number of processes; -1: `$WORLD_SIZE`.
  TORCH_ARG(int64_t, world_size) = -1;
  /// Where the ranks meet. Null: a `c10d::TCPStore` at
  /// `$MASTER_ADDR:$MASTER_PORT`, served by rank 0 (or by torchrun's agent
  /// when `$TORCHELASTIC_USE_AGENT_STORE` is True).
  TORCH_ARG(c10::intrusive_ptr<c10d::Store>, store) = {};
  /// How long the rendezvous and each collective may wait.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// The group's name, the same on every rank: its keys in the store live
  /// under it. Empty: `gpipe_<n>` for the n-th call of this process.
  TORCH_ARG(std::string, group_name) = "";
};

/// Makes a process group of `options.backend()` over the ranks that meet at
/// the store, as Python's `torch.distributed.new_group` would: every rank
/// calls it with the same backend and group name (by default the n-th call
/// of each process joins the other processes' n-th calls). Blocks until all
/// `world_size` ranks have joined. Throws, naming the value and the fix, for
/// a bad rank or world size, a missing environment variable, or a backend
/// this build of gpipe lacks (see `has_backend`).
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(
    const ProcessGroupOptions& options = ProcessGroupOptions());

/// Whether this build of gpipe can make groups of `backend` ("gloo",
/// "nccl"): Gloo needs Gloo's headers when gpipe is built (Debian's
/// `libgloo-dev`; CMake reports whether they match torch's
/// ProcessGroupGloo.hpp), NCCL a CUDA build of torch and `nccl.h`.
bool has_backend(const std::string& backend);

}  // namespace distributed
}  // namespace gpipe
