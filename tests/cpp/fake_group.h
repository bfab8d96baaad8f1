// fake_group.h — in-process c10d process groups for tests: R ranks as threads of one process, matching sends to receives as Gloo (by tag) or NCCL (by order) does.
//
// The pip wheel of torch ships no Gloo headers, so a C++ test cannot build a
// real group of several ranks. These fakes stand in: each rank is a thread
// holding its own `c10d::ProcessGroup` (backend registered for CPU and CUDA)
// over one shared world. Every wait is bounded: a deadlock fails with an
// error naming the pair and the ops, never hangs.
//
//   ByTag   (Gloo): a recv from src with tag t takes the oldest unmatched
//           send from src with tag t; a send completes at once (a buffered
//           copy), so receives may be posted in any order.
//   ByOrder (NCCL): tags are ignored. Per peer, a rank has ONE in-order
//           queue holding its sends to and receives from that peer; an op
//           starts once the ops before it completed. A send and the peer's
//           receive meet when both head their queues (a rendezvous), then
//           the bytes move. So two ranks queueing [recv, send] against each
//           other wait forever, as NCCL does:
//
//             rank 0 -> rank 1 queue:  recv X  | send Y
//             rank 1 -> rank 0 queue:  recv Y  | send X      (both heads recv)
//
// A second set of groups over the same ranks (another make_fake_groups call)
// has queues of its own, as a second NCCL communicator does.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace gpipe_test {

enum class FakeMatching { ByTag, ByOrder };

/// One `c10d::ProcessGroup` per rank (index r is rank r) of a `ranks`-rank
/// world. Supported: send and recv of one tensor, allreduce (SUM) of one
/// tensor, barrier; each Work's wait() throws after `timeout`, naming the
/// op and the pair. `backend_name` is what getBackendName() says ("gloo"
/// makes the group's backend type GLOO; anything else CUSTOM).
/// `like_nccl`: Works behave as ProcessGroupNCCL's do where the host can
/// tell: a send's or receive's wait() does not block (it returns at once,
/// throwing only for an op that already failed; on a GPU it would order the
/// current stream), so only isCompleted() says it is done; and abort()
/// fails every op of the world, pending and later (ncclCommAbort; torch's
/// watchdog would then end the process). A collective's wait still blocks:
/// on a GPU the host reads its result through a device-to-host copy, which
/// waits for it, and a CPU tensor cannot model that. Without `like_nccl`,
/// wait() blocks and abort() takes that op off its queue only, as Gloo's
/// do.
std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> make_fake_groups(
    int ranks, FakeMatching matching,
    std::chrono::milliseconds timeout = std::chrono::seconds(20),
    std::string backend_name = "", bool like_nccl = false);
// (An empty `backend_name`: "gloo" for ByTag, "fake_nccl" for ByOrder.)

/// How many sends `group`'s rank has posted so far (every message: a
/// transport's header, tensors, filler), for tests of the wire protocol.
int64_t sends_posted(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

/// Runs `body(rank)` for every rank at once, each on a thread of its own
/// (the ranks of a step wait on each other), joins them all, and returns
/// each rank's error message ("" where `body` returned). Catch's CHECKs are
/// not thread-safe: check the results on the caller's thread.
std::vector<std::string> run_ranks(int ranks, const std::function<void(int rank)>& body);

}  // namespace gpipe_test
