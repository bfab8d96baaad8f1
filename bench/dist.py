"""gpipe.distributed against torch.distributed.pipelining: 4 CPU processes, Gloo, the same run.

    python3 bench/dist.py [--quick]

Both run one stage per process (K = 4 ranks of one Gloo group on localhost,
spawned once; every row runs in these same processes, one after the
other), M = 16 micro-batches, checkpoint never, loss = output.sum(), on
peer.py's models (8 layers, 2 per stage):
  sim   split sleep layers (forward 1 ms, backward 1 ms + 1 ms per layer).
  tiny  8 x Linear(16, 16), batch 64.
Schedules: gpipe.distributed.Pipe(schedule='gpipe' | '1f1b') against
pipelining's ScheduleGPipe | Schedule1F1B. A step's time is peer.py's:
the median over blocks of (block time / steps), a Gloo barrier before and
after each block.

From gpipe's trace (tracing on for extra steps, after the timing), per
step: `compute` is the busiest rank's time in its cells (forward, loss,
backward), `rest` the step time minus that: what the pipeline bubble, the
hand-offs (header and tensors by isend/irecv, waiting for the peer) and the
engine cost on the busiest rank together. The last lines are
`BENCH dist model=<sim|tiny> schedule=<name> pipelining_over_gpipe=...`
(theirs / ours: above 1 means gpipe is faster) and, per model and
schedule, gpipe's `rest_ms`.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (the models, the timing, the spawning helpers)

K = peer.K
SCHEDULES = [("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")]


def worker(rank: int, port: int, names: list, quick: bool, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    import gpipe.distributed

    peer.set_timer_slack()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    results = {}
    try:
        for name in names:
            cfg = peer.config(name, quick)
            x = peer.make_input(name, cfg["m"])
            for ours, theirs in SCHEDULES:
                # gpipe.distributed
                model = peer.make_schedule_model(name, cfg["t"])
                pipe = gpipe.distributed.Pipe(model, [len(model) // K] * K, chunks=cfg["m"],
                                              checkpoint="never", schedule=ours)
                target = torch.zeros(x.shape[0], 1)

                def step():
                    pipe.train_step(x if pipe.is_first else None,
                                    target=target if pipe.is_last else None,
                                    loss_fn=lambda out, y: out.sum())

                ours_s = peer.time_blocks(step, cfg, sync=dist.barrier)
                # The trace of a few more steps: this rank's busy time per step.
                pipe._engine.tracing = True
                traced = 1 if quick else 5
                dist.barrier()
                start = time.perf_counter()
                for _ in range(traced):
                    step()
                dist.barrier()
                traced_s = (time.perf_counter() - start) / traced
                summary = pipe._engine.trace().summary()
                busy = sum(summary.busy_us) / 1e6 / traced
                busiest = [0.0] * K
                busiest[rank] = busy
                t = torch.tensor(busiest)
                dist.all_reduce(t)
                # torch.distributed.pipelining
                model = peer.make_schedule_model(name, cfg["t"])
                per = len(model) // K
                stage = pipelining.PipelineStage(
                    nn.Sequential(*list(model)[rank * per:(rank + 1) * per]), rank, K,
                    torch.device("cpu"))
                schedule = getattr(pipelining, theirs)(
                    stage, n_microbatches=cfg["m"], loss_fn=lambda out, y: out.sum(),
                    scale_grads=False)
                one = torch.zeros(1)

                def their_step():
                    kwargs = dict(target=one, losses=[]) if rank == K - 1 else {}
                    if rank == 0:
                        schedule.step(x, **kwargs)
                    else:
                        schedule.step(**kwargs)

                theirs_s = peer.time_blocks(their_step, cfg, sync=dist.barrier)
                results[f"{name}/{ours}"] = dict(ours=ours_s, theirs=theirs_s,
                                                 traced=traced_s, compute=max(t.tolist()))
                if rank == 0:
                    with open(path, "w") as f:
                        json.dump(results, f)
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke configuration")
    args = parser.parse_args()
    names = ["sim", "tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(peer.free_port(), names, args.quick, path), nprocs=K)
        with open(path) as f:
            results = json.load(f)
    print(f"{'model':6} {'schedule':9} {'gpipe ms':>9} {'pipelining ms':>14} {'theirs/ours':>12}"
          f" {'compute ms':>11} {'rest ms':>8}")
    lines = []
    for key, r in results.items():
        name, schedule = key.split("/")
        ratio = r["theirs"] / r["ours"]
        rest = r["traced"] - r["compute"]
        print(f"{name:6} {schedule:9} {r['ours'] * 1e3:9.2f} {r['theirs'] * 1e3:14.2f} "
              f"{ratio:12.2f} {r['compute'] * 1e3:11.2f} {rest * 1e3:8.2f}")
        lines.append(f"BENCH dist model={name} schedule={schedule} "
                     f"pipelining_over_gpipe={ratio:.2f} rest_ms={rest * 1e3:.2f}")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
