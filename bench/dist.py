"""gpipe.distributed against torch.distributed.pipelining: 4 CPU processes, Gloo, the same run.

    python3 bench/dist.py [--quick] [--only time|memory|dp]

Both run one stage per process (K = 4 ranks of one Gloo group on localhost,
spawned once; every row runs in these same processes, one after the
other), or two in a V under zb_v, M = 16 micro-batches, checkpoint never,
loss = output.sum(), on peer.py's models (8 layers, 2 per stage, 1 per stage
under zb_v):
  sim   split sleep layers (forward 1 ms, backward 1 ms + 1 ms per layer).
  tiny  8 x Linear(16, 16), batch 64.
Schedules: gpipe.distributed.Pipe(schedule='gpipe' | '1f1b' | 'zb_v') against
pipelining's ScheduleGPipe | Schedule1F1B | ScheduleZBVZeroBubble (zb_v:
rank r holds stages r and 2K - 1 - r on both sides; a pipelining schedule
that fails is reported, its row left out). A step's time is peer.py's:
the median over blocks of (block time / steps), a Gloo barrier before and
after each block.

From gpipe's trace (tracing on for extra steps, after the timing; every
rank's events are put on the machine's steady clock with the engine's
trace_origin_ns and gathered on rank 0), per step:
  compute     the busiest rank's time in its cells (forward, loss, backward).
  rest        the step time minus that: bubble, hand-offs and engine cost on
              the busiest rank together.
  A remote hand-off has a Send span on the sending rank (S0..S1: its worker
  in the transport's send) and a Receive span on the receiving rank (R0..R1:
  its worker in the transport's receive, from asking until it has the data),
  matched by step, the two stages and the micro-batch. The receive's time
  splits at S0: R0..min(S0, R1) is bubble (the peer had not started sending:
  it was still computing, or busy elsewhere), max(R0, S0)..R1 is
  communication (the data was on its way).
  handoff_us  the median of R1 - S0 over the hand-offs whose receiver was
              already waiting (R0 < S0): the latency from the sender's call
              to the receiver having the data, when nothing else delays it.
  send_ms     the busiest rank's time per step inside sends.
  comm_ms     the busiest rank's communication per step: the communication
              part of its receives (sum of R1 - max(R0, S0)) plus send_ms:
              time its worker was held by hand-offs, neither computing nor
              waiting for a peer's compute.
  us/send     the median time of one send call, over every rank.
  The decomposition lines split the busiest rank's traced step (its first
  event's start to its last event's end) into compute, receive bubble,
  receive communication, sends and gaps (engine cost between tasks: the
  worker in none of these spans), against the ideal schedule time
  (M + K - 1) x (F + B) of the nominal sleeps (sim only).
The last lines are
`BENCH dist model=<sim|tiny> schedule=<name> pipelining_over_gpipe=...
comm_ms=... handoff_us=... send_ms=...` (theirs / ours: above 1 means gpipe
is faster).

Memory (its own 4 processes, after the timing; `--only memory` runs it
alone): the peak RSS growth of each rank during one training step under
gpipe.distributed.Pipe(schedule='gpipe') and (schedule='1f1b'), K = 4, M = 16,
checkpoint never, on 8 x (Linear(2048, 2048) + ReLU), batch 4096 (--quick:
Linear(256, 256), batch 256), loss = output.sum(). The weight matrices are
frozen and the biases train (8 KiB of grads), and the input needs no grad:
so every stage keeps its graph between F and B (its two ReLUs' outputs,
2 MiB each per micro-batch), and nothing else grows with M but what the
transport holds. Per rank: glibc's mmap threshold fixed at 64 KiB (so a
freed tensor goes back to the kernel and RSS follows live memory; with
glibc's default, freed heap memory stays resident and the high-water mark
measures fragmentation), a warm-up step, malloc_trim, then VmRSS is the
baseline and VmHWM is reset to it (writing 5 to /proc/self/clear_refs);
the growth is VmHWM - baseline after the step, the larger of two steps
(--quick: one).
1F1B holds at most K - j micro-batches on stage j against GPipe's M.
The last line is
`BENCH dist memory schedule=1f1b peak_over_gpipe=<ratio>`: the largest over
the ranks of (1f1b growth / gpipe growth).

Data parallel (its own 4 processes; `--only dp` runs it alone): the same
job as 2 pipeline ranks x 2 replicas on a DeviceMesh ("pp", "dp"),
schedule 1f1b, M = 8, checkpoint never, 8 x (Linear(512, 512) + ReLU)
(--quick: Linear(64, 64)), 128 rows per replica, loss = output.sum(), an
SGD step included. The grads are averaged over "dp" two ways:
  dp_group   gpipe's own bucketed all_reduce (dp_group=mesh["dp"], buckets
             launched as each stage's grads are final).
  fsdp       every layer fully_shard-ed over "dp" (FSDP2; gpipe gathers
             each unit once per step and reduce-scatters once at its end).
  replicate  every layer replicate-d over "dp" (FSDP2's DDP-style units,
             torch.distributed._composable.replicate_with_fsdp: parameters
             whole on every replica, one all_reduce per unit per step).
A step's time is the median over blocks (time_blocks), the two
interleaved block by block. Both start from the same parameters and take
the same steps on the same batches: their parameters after the timing are
compared (the largest difference is printed). The last line is
`BENCH dist dp fsdp_over_dp_group=<ratio> replicate_over_dp_group=<ratio>`:
their step times over dp_group's (above 1: gpipe's own all_reduce is faster).
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (the models, the timing, the spawning helpers)

K = peer.K
# gpipe's schedule, pipelining's of the same name, and the stages per rank (2: in a V).
SCHEDULES = [("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
             ("zb_v", "ScheduleZBVZeroBubble", 2)]

COMPUTE = ("forward", "backward", "recompute", "loss", "input_grad", "weight_grad")


def analyse(ranks: list, steps: int) -> dict:
    """The hand-off figures of the module docstring from every rank's events
    (step, stage, microbatch, phase, peer, start_us, end_us), times on one
    clock; per step, averaged over the `steps` traced steps."""
    sends = {}
    for events in ranks:
        for step, stage, i, phase, peer, start, end in events:
            if phase == "send":
                sends[(step, stage, peer, i)] = (start, end)
    per_rank = []
    latencies = []
    durations = [end - start for events in ranks
                 for step, stage, i, phase, peer, start, end in events if phase == "send"]
    unmatched = 0
    for events in ranks:
        r = dict(compute=0.0, bubble=0.0, comm=0.0, send=0.0, span=0.0)
        first, last = {}, {}
        for step, stage, i, phase, peer, start, end in events:
            first[step] = min(first.get(step, start), start)
            last[step] = max(last.get(step, end), end)
            if phase in COMPUTE:
                r["compute"] += end - start
            elif phase == "send":
                r["send"] += end - start
            elif phase == "receive":
                sent = sends.get((step, peer, stage, i))
                if sent is None:
                    unmatched += 1
                    r["comm"] += end - start
                    continue
                s0 = sent[0]
                r["bubble"] += max(0.0, min(s0, end) - start)
                r["comm"] += end - max(start, s0)
                if start < s0:
                    latencies.append(end - s0)
        r["span"] = sum(last[k] - first[k] for k in first)
        per_rank.append({k: v / steps for k, v in r.items()})
    busiest = max(per_rank, key=lambda r: r["compute"])
    gap = busiest["span"] - busiest["compute"] - busiest["bubble"] - busiest["comm"] \
        - busiest["send"]
    return dict(compute=busiest["compute"] / 1e6, send_ms=busiest["send"] / 1e3,
                comm_ms=(busiest["comm"] + busiest["send"]) / 1e3,
                recv_comm_ms=busiest["comm"] / 1e3, bubble_ms=busiest["bubble"] / 1e3,
                gap_ms=gap / 1e3, span_ms=busiest["span"] / 1e3,
                handoff_us=statistics.median(latencies) if latencies else float("nan"),
                waited=len(latencies), unmatched=unmatched,
                send_us=statistics.median(durations) if durations else float("nan"))


def worker(rank: int, port: int, names: list, quick: bool, path: str) -> None:
    import torch.distributed as dist

    import gpipe.distributed

    peer.set_timer_slack()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    # pipelining's stages talk over a group of their own with a short timeout: when one of
    # its ranks fails (ZBV's self-send on Gloo), the others' waits end within it.
    theirs_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    results = {}
    broken = None  # why theirs_group is unusable (a failed pipelining row)
    try:
        # Schedule by schedule, every model: a pipelining schedule that breaks its group
        # (zb_v, last) costs only the rows after it.
        for ours, theirs, v in SCHEDULES:
            for name in names:
                cfg = peer.config(name, quick)
                x = peer.make_input(name, cfg["m"])
                # gpipe.distributed
                model = peer.make_schedule_model(name, cfg["t"])
                pipe = gpipe.distributed.Pipe(model, [len(model) // (K * v)] * (K * v),
                                              chunks=cfg["m"], checkpoint="never",
                                              schedule=ours)
                target = torch.zeros(x.shape[0], 1)

                def step():
                    pipe.train_step(x if pipe.is_first else None,
                                    target=target if pipe.is_last else None,
                                    loss_fn=lambda out, y: out.sum())

                ours_s = peer.time_blocks(step, cfg, sync=dist.barrier)
                # The trace of a few more steps: this rank's busy time per step.
                pipe.tracing = True
                traced = 1 if quick else 5
                dist.barrier()
                start = time.perf_counter()
                for _ in range(traced):
                    step()
                dist.barrier()
                traced_s = (time.perf_counter() - start) / traced
                origin_us = pipe.trace_origin_ns / 1e3
                events = [(e.step, e.stage, e.microbatch, e.phase, e.peer,
                           origin_us + e.start_us, origin_us + e.end_us)
                          for e in pipe.trace.events]
                pipe.tracing = False
                gathered = [None] * K
                dist.all_gather_object(gathered, events)
                comm = analyse(gathered, traced) if rank == 0 else {}
                # torch.distributed.pipelining, the same stages on the same ranks
                failure = None
                try:
                    if broken:
                        raise RuntimeError(f"not run: {broken}")
                    their_step = peer.pipelining_step(theirs, "one" if v == 1 else "v", rank,
                                                      name, cfg, group=theirs_group)
                    theirs_s = peer.time_blocks(
                        their_step, cfg, sync=lambda: dist.barrier(group=theirs_group))
                except Exception as e:  # reported, not hidden: its row says why
                    theirs_s = None
                    failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
                # Every rank learns whether any failed (a failing rank's peers may have
                # run on): a row times both sides or neither.
                failures = [None] * K
                dist.all_gather_object(failures, failure)
                # The cause first: a rank whose own call failed, not one that timed out
                # waiting for it.
                failed = next((f"rank {r}: {f}" for r, f in sorted(
                    enumerate(failures), key=lambda rf: "Timed out" in (rf[1] or ""))
                    if f), None)
                results[f"{name}/{ours}"] = dict(ours=ours_s,
                                                 theirs=None if failed else theirs_s,
                                                 failure=failed, traced=traced_s, **comm)
                if rank == 0:
                    with open(path, "w") as f:
                        json.dump(results, f)
                if failed and not broken:
                    # Their failed step may leave messages in flight on their group: no
                    # later pipelining row runs on it (gpipe's run on the world group).
                    broken = f"pipelining's group broke at {name}/{theirs}"
    finally:
        dist.destroy_process_group()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def status_bytes(field: str) -> int:
    """A field of /proc/self/status ("VmRSS", "VmHWM") in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_high_water_mark() -> bool:
    """VmHWM back to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_config(quick: bool) -> dict:
    """Width, batch, micro-batches and measured steps of the memory section."""
    return dict(hidden=256, batch=256, m=16, reps=1) if quick else \
        dict(hidden=2048, batch=4096, m=16, reps=2)


def gather_to(path: str, rank: int, result: Any) -> None:
    """Every rank's `result`, in rank order, written by rank 0 to `path` as JSON (a collective:
    every rank calls it)."""
    import torch.distributed as dist

    gathered = [None] * K
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(gathered, f)


def spawn_gathered(worker: Callable[..., None], quick: bool) -> list:
    """Runs worker(rank, port, quick, path) on K processes; returns what it gather_to-ed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.json")
        mp.spawn(worker, args=(peer.free_port(), quick, path), nprocs=K)
        with open(path) as f:
            return json.load(f)


def memory_worker(rank: int, port: int, quick: bool, path: str) -> None:
    """The memory section of the docstring, on one rank: its peak growth in MiB per schedule."""
    # Before the first large allocation: tensors of 64 KiB or more are each
    # their own mapping, returned to the kernel when freed.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    import torch.distributed as dist

    import gpipe.distributed

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    cfg = memory_config(quick)
    growth = {}
    try:
        for schedule in ("gpipe", "1f1b"):
            torch.manual_seed(0)
            layers = []
            for _ in range(2 * K):
                layers += [nn.Linear(cfg["hidden"], cfg["hidden"]), nn.ReLU()]
            model = nn.Sequential(*layers)
            for name, p in model.named_parameters():
                p.requires_grad_(name.endswith("bias"))
            pipe = gpipe.distributed.Pipe(model, [len(model) // K] * K, chunks=cfg["m"],
                                          checkpoint="never", schedule=schedule)
            x = torch.randn(cfg["batch"], cfg["hidden"]) if pipe.is_first else None
            target = torch.zeros(cfg["batch"], 1) if pipe.is_last else None

            def step():
                pipe.train_step(x, target=target, loss_fn=lambda out, y: out.sum())

            step()  # warm-up: grads allocated, the transport knows last step's shapes
            peaks = []
            for _ in range(cfg["reps"]):
                dist.barrier()
                libc.malloc_trim(0)
                baseline = status_bytes("VmRSS")
                if not reset_high_water_mark():
                    raise RuntimeError("cannot reset VmHWM (writing 5 to /proc/self/clear_refs "
                                       "failed); this section needs it")
                step()
                peaks.append((status_bytes("VmHWM") - baseline) / 2**20)
            growth[schedule] = max(peaks)
            del pipe, model, x, target
            dist.barrier()
        gather_to(path, rank, growth)
    finally:
        dist.destroy_process_group()


def memory_section(quick: bool) -> None:
    """The memory section of the docstring: per-rank growth, the BENCH line."""
    cfg = memory_config(quick)
    ranks = spawn_gathered(memory_worker, quick)
    print(f"\nPeak RSS growth during one training step, MiB (8 x (Linear({cfg['hidden']}, "
          f"{cfg['hidden']}) + ReLU), batch {cfg['batch']}, K = {K}, M = {cfg['m']}, "
          f"checkpoint never, weight matrices frozen):")
    print(f"{'rank':>4} {'gpipe MiB':>10} {'1f1b MiB':>9} {'1f1b/gpipe':>11}")
    ratios = []
    for rank, g in enumerate(ranks):
        ratio = g["1f1b"] / g["gpipe"] if g["gpipe"] > 0 else float("nan")
        ratios.append(ratio)
        print(f"{rank:4d} {g['gpipe']:10.1f} {g['1f1b']:9.1f} {ratio:11.3f}")
    print(f"BENCH dist memory schedule=1f1b peak_over_gpipe={max(ratios):.3f}")


def dp_worker(rank: int, port: int, quick: bool, path: str) -> None:
    """The data-parallel section of the docstring, on one rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    import gpipe.distributed

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    hidden = 64 if quick else 512
    cfg = dict(warmup=1, blocks=3 if quick else 7, per_block=2 if quick else 4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))

        def model():
            torch.manual_seed(0)
            layers = []
            for _ in range(8):
                layers += [nn.Linear(hidden, hidden), nn.ReLU()]
            return nn.Sequential(*layers)

        ours = gpipe.distributed.Pipe(model(), [8, 8], chunks=8, checkpoint="never", mesh=mesh,
                                      dp_group=mesh["dp"].get_group())
        sharded = gpipe.distributed.Pipe(model(), [8, 8], chunks=8, checkpoint="never",
                                         mesh=mesh)
        for layer in sharded.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        replicated = gpipe.distributed.Pipe(model(), [8, 8], chunks=8, checkpoint="never",
                                            mesh=mesh)
        for layer in replicated.children():
            if any(True for _ in layer.parameters()):
                replicate(layer, mesh=mesh["dp"])
        torch.manual_seed(1 + mesh["dp"].get_local_rank())
        x = torch.randn(128, hidden)

        def stepper(pipe):
            opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

            def step():
                opt.zero_grad()
                pipe.train_step(x if pipe.is_first else None,
                                torch.zeros(128, 1) if pipe.is_last else None,
                                loss_fn=lambda out, y: out.sum())
                opt.step()
            return step

        steps = {"dp_group": stepper(ours), "fsdp": stepper(sharded),
                 "replicate": stepper(replicated)}
        times = {name: [] for name in steps}
        for name, step in steps.items():
            for _ in range(cfg["warmup"]):
                step()
        for _ in range(cfg["blocks"]):
            for name, step in steps.items():
                times[name].append(peer.time_blocks(
                    step, dict(warmup=0, blocks=1, per_block=cfg["per_block"]),
                    sync=dist.barrier))
        # Both started from the same parameters and took the same steps on the same batches.
        reference = dict(ours.named_parameters())
        diff = max((p.full_tensor() - reference[n]).abs().max().item()
                   for other in (sharded, replicated) for n, p in other.named_parameters())
        result = {name: statistics.median(t) for name, t in times.items()}
        result["diff"] = diff
        gather_to(path, rank, result)
    finally:
        dist.destroy_process_group()


def dp_section(quick: bool) -> None:
    """The data-parallel section of the docstring: step times, the largest difference."""
    ranks = spawn_gathered(dp_worker, quick)
    ours = max(r["dp_group"] for r in ranks)
    theirs = max(r["fsdp"] for r in ranks)
    replicated = max(r["replicate"] for r in ranks)
    diff = max(r["diff"] for r in ranks)
    print(f"\nPipeline x data parallel (2 x 2 ranks, 1f1b, M = 8, an SGD step included), "
          f"ms per step (slowest rank):")
    print(f"  dp_group (gpipe's all_reduce)   {ours * 1e3:8.1f}")
    print(f"  fsdp (fully_shard per layer)    {theirs * 1e3:8.1f}")
    print(f"  replicate (FSDP2's, per layer)  {replicated * 1e3:8.1f}")
    print(f"  largest parameter difference after the same steps from the same start: "
          f"{diff:.2e}")
    print(f"BENCH dist dp fsdp_over_dp_group={theirs / ours:.3f} "
          f"replicate_over_dp_group={replicated / ours:.3f}")


def ideal_ms(name: str, quick: bool) -> float:
    """(M + K - 1) x (F + B) of the nominal sleeps for sim (F = t, B = 2t per
    stage); nan for tiny, whose layers have no nominal time."""
    if name != "sim":
        return float("nan")
    cfg = peer.config(name, quick)
    return (cfg["m"] + K - 1) * 3 * cfg["t"] * 1e3


def time_section(quick: bool) -> None:
    """The step times and hand-off figures of the docstring: the table, the BENCH lines."""
    names = ["sim", "tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(peer.free_port(), names, quick, path), nprocs=K)
        with open(path) as f:
            results = json.load(f)
    print(f"{'model':6} {'schedule':9} {'gpipe ms':>9} {'pipelining ms':>14} {'theirs/ours':>12}"
          f" {'compute ms':>11} {'rest ms':>8} {'comm ms':>8} {'handoff us':>11}"
          f" {'send ms':>8}")
    lines = []
    for key, r in results.items():
        name, schedule = key.split("/")
        ratio = r["theirs"] / r["ours"] if r["theirs"] else float("nan")
        rest = r["traced"] - r["compute"]
        theirs = f"{r['theirs'] * 1e3:14.2f}" if r["theirs"] else f"{'failed':>14}"
        print(f"{name:6} {schedule:9} {r['ours'] * 1e3:9.2f} {theirs} "
              f"{ratio:12.2f} {r['compute'] * 1e3:11.2f} {rest * 1e3:8.2f} {r['comm_ms']:8.2f}"
              f" {r['handoff_us']:11.0f} {r['send_ms']:8.2f}")
        if r["failure"]:
            print(f"  pipelining {schedule} failed: {r['failure']}")
        lines.append(f"BENCH dist model={name} schedule={schedule} "
                     f"pipelining_over_gpipe={ratio:.2f} comm_ms={r['comm_ms']:.2f} "
                     f"handoff_us={r['handoff_us']:.0f} send_ms={r['send_ms']:.2f} "
                     f"rest_ms={rest * 1e3:.2f}")
    print("\nThe busiest rank's traced step, ms per step (gaps: engine cost between tasks):")
    print(f"{'model':6} {'schedule':9} {'ideal':>7} {'span':>7} {'compute':>8} {'bubble':>7}"
          f" {'recv comm':>10} {'send':>6} {'gaps':>6} {'waited':>7} {'us/send':>8}")
    for key, r in results.items():
        name, schedule = key.split("/")
        ideal = ideal_ms(name, quick)
        print(f"{name:6} {schedule:9} {ideal:7.1f} {r['span_ms']:7.2f} {r['compute'] * 1e3:8.2f}"
              f" {r['bubble_ms']:7.2f} {r['recv_comm_ms']:10.2f} {r['send_ms']:6.2f}"
              f" {r['gap_ms']:6.2f} {r['waited']:7d} {r['send_us']:8.0f}")
        if r["unmatched"]:
            print(f"  ({r['unmatched']} receives without a matching send)")
    for line in lines:
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke configuration")
    parser.add_argument("--only", choices=["time", "memory", "dp"],
                        help="run one section (default: all)")
    args = parser.parse_args()
    if args.only in (None, "time"):
        time_section(args.quick)
    if args.only in (None, "memory"):
        memory_section(args.quick)
    if args.only in (None, "dp"):
        dp_section(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
