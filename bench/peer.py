# peer.py — gpipe's Python Pipe next to torch.distributed.pipelining and torchgpipe, same models, same run.
"""Step time of the same pipelined training step under three GPipe implementations.

    python3 bench/peer.py [--quick] [--torchgpipe-dir DIR]

Models (K = 4 stages, M = 16 micro-batches, CPU, checkpoint never, loss = output.sum()):
  sim   4 sleep layers, one per stage: forward sleeps t = 2 ms, backward 2t
        (a custom autograd.Function), like sim.cpp's but in Python.
  tiny  8 x Linear(16, 16), 2 per stage, batch 64: overhead.cpp's model.

Frameworks:
  gpipe       gpipe.Pipe, 4 CPU stages in this process (C++ workers; the
              Python layers run under the GIL).
  pipelining  torch.distributed.pipelining: PipelineStage + ScheduleGPipe,
              Gloo, one process per stage on localhost (torch.multiprocessing).
  torchgpipe  torchgpipe 0.0.7 from PyPI (GPipe, devices=['cpu'] * 4), imported
              from --torchgpipe-dir (bench/run installs it there with
              `pip install --target`); it is never added to requirements.txt.

Every process sets one intra-op thread and 1 ns timer slack (so sleeps end
on time alike). A step's time is the median over blocks of consecutive
steps of (block time / steps); for pipelining, a Gloo barrier starts and
ends each block, so the barrier's cost is spread over the block's steps.
The last lines are `BENCH peer model=... pipelining_over_gpipe=...
torchgpipe_over_gpipe=...` (theirs / ours: above 1 means gpipe is faster).
"""
import argparse
import ctypes
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch import nn

K = 4
PR_SET_TIMERSLACK = 29


def set_timer_slack() -> None:
    """1 ns timer slack for this thread and the threads it creates from now on."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class SleepFn(torch.autograd.Function):
    """Identity whose forward sleeps t and whose backward sleeps 2t."""

    @staticmethod
    def forward(ctx, x, w, t):  # type: ignore[override]
        ctx.t = t
        time.sleep(t)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(2 * ctx.t)
        return grad, torch.zeros(1), None


class Sleep(nn.Module):
    """A sleep layer with one parameter, so its backward runs on stage 0 too."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return SleepFn.apply(x, self.w, self.t)


def make_model(name: str, t: float) -> nn.Sequential:
    torch.manual_seed(0)
    if name == "sim":
        return nn.Sequential(*[Sleep(t) for _ in range(K)])
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(2 * K)])


def make_input(name: str, m: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.zeros(m, 8) if name == "sim" else torch.randn(64, 16)


def config(name: str, quick: bool) -> dict:
    """Micro-batches, sleep, warm-up steps, blocks and steps per block for a model."""
    if name == "sim":
        return dict(m=4 if quick else 16, t=0.001 if quick else 0.002, warmup=1,
                    blocks=1 if quick else 5, per_block=1 if quick else 2)
    return dict(m=4 if quick else 16, t=0.0, warmup=2 if quick else 20,
                blocks=1 if quick else 7, per_block=3 if quick else 20)


def time_blocks(step, cfg: dict, sync=lambda: None) -> float:
    """Median over blocks of seconds per step; `sync` runs before and after each block."""
    for _ in range(cfg["warmup"]):
        step()
    per_step = []
    for _ in range(cfg["blocks"]):
        sync()
        start = time.perf_counter()
        for _ in range(cfg["per_block"]):
            step()
        sync()
        per_step.append((time.perf_counter() - start) / cfg["per_block"])
    return statistics.median(per_step)


# ---- in this process: plain, gpipe, torchgpipe ----------------------------------------------


def time_plain(name: str, cfg: dict) -> float:
    model = make_model(name, cfg["t"])
    x = make_input(name, cfg["m"])
    return time_blocks(lambda: model(x).sum().backward(), cfg)


def time_gpipe(name: str, cfg: dict) -> float:
    import gpipe

    model = make_model(name, cfg["t"])
    pipe = gpipe.Pipe(model, balance=[len(model) // K] * K, devices=["cpu"] * K,
                      chunks=cfg["m"], checkpoint="never")
    x = make_input(name, cfg["m"])
    return time_blocks(lambda: pipe(x).sum().backward(), cfg)


def time_torchgpipe(name: str, cfg: dict) -> float:
    from torchgpipe import GPipe

    model = make_model(name, cfg["t"])
    pipe = GPipe(model, balance=[len(model) // K] * K, devices=["cpu"] * K,
                 chunks=cfg["m"], checkpoint="never")
    x = make_input(name, cfg["m"])
    return time_blocks(lambda: pipe(x).sum().backward(), cfg)


# ---- torch.distributed.pipelining: one process per stage --------------------------------------


def pipelining_worker(rank: int, port: int, names: list, quick: bool, result_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    set_timer_slack()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    try:
        results = {}
        for name in names:
            cfg = config(name, quick)
            model = make_model(name, cfg["t"])
            per = len(model) // K
            part = nn.Sequential(*list(model)[rank * per:(rank + 1) * per])
            stage = PipelineStage(part, rank, K, torch.device("cpu"))
            schedule = ScheduleGPipe(stage, n_microbatches=cfg["m"],
                                     loss_fn=lambda out, target: out.sum(), scale_grads=False)
            x = make_input(name, cfg["m"])
            target = torch.zeros(1)

            def step():
                if rank == 0:
                    schedule.step(x)
                elif rank == K - 1:
                    schedule.step(target=target, losses=[])
                else:
                    schedule.step()

            results[name] = time_blocks(step, cfg, sync=dist.barrier)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_pipelining(names: list, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(pipelining_worker, args=(free_port(), names, quick, path), nprocs=K, join=True)
        with open(path) as f:
            return json.load(f)


# ---- report -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke configuration (also BENCH_QUICK=1)")
    parser.add_argument("--torchgpipe-dir", default=os.environ.get("TORCHGPIPE_DIR", ""),
                        help="a directory holding torchgpipe 0.0.7 (pip install --target DIR "
                             "torchgpipe==0.0.7 --no-deps); empty: skip torchgpipe")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("BENCH_QUICK", "0") not in ("", "0")

    set_timer_slack()
    torch.set_num_threads(1)
    names = ["sim", "tiny"]
    try:
        import gpipe
    except ImportError as e:
        print(f"peer: cannot import gpipe ({e}); install it first: "
              f"GPIPE_CMAKE_BUILD_DIR=$PWD/build python3 -m pip install --no-build-isolation "
              f"--no-deps .  (bench/run does this)", file=sys.stderr)
        return 1

    torchgpipe_note = ""
    if args.torchgpipe_dir and os.path.isdir(os.path.join(args.torchgpipe_dir, "torchgpipe")):
        sys.path.insert(0, args.torchgpipe_dir)
    else:
        torchgpipe_note = (f"not installed in {args.torchgpipe_dir or '(no --torchgpipe-dir)'}; "
                           f"pip install --target DIR --no-deps torchgpipe==0.0.7")

    times = {name: {} for name in names}
    for name in names:
        cfg = config(name, quick)
        times[name]["plain"] = time_plain(name, cfg)
        times[name]["gpipe"] = time_gpipe(name, cfg)
        if not torchgpipe_note:
            try:
                times[name]["torchgpipe"] = time_torchgpipe(name, cfg)
            except Exception as e:  # report, don't hide: it is an old package on a new torch
                torchgpipe_note = f"fails on torch {torch.__version__}: {type(e).__name__}: {e}"
                traceback.print_exc()
    try:
        for name, seconds in time_pipelining(names, quick).items():
            times[name]["pipelining"] = seconds
        pipelining_note = ""
    except Exception as e:
        pipelining_note = f"failed: {type(e).__name__}: {e}"
        traceback.print_exc()

    print(f"peer: K={K} stages on CPU, checkpoint never, loss = output.sum(), 1 intra-op thread "
          f"per process; torch {torch.__version__}, gpipe from {os.path.dirname(gpipe.__file__)}")
    for name in names:
        cfg = config(name, quick)
        what = (f"{K} sleep layers (t = {cfg['t'] * 1e3:g} ms forward, 2t backward), "
                f"M={cfg['m']}, ideal {(cfg['m'] + K - 1) * 3 * cfg['t'] * 1e3:.0f} ms"
                if name == "sim" else
                f"{2 * K} x Linear(16, 16), batch 64, M={cfg['m']}")
        print(f"\nmodel {name}: {what}; median over {cfg['blocks']} blocks of "
              f"{cfg['per_block']} steps after {cfg['warmup']} warm-up")
        rows = [("plain nn.Sequential, whole batch (reference)", "plain"),
                ("gpipe.Pipe (1 process, 4 threads)", "gpipe"),
                ("torch.distributed.pipelining (4 processes, Gloo)", "pipelining"),
                ("torchgpipe 0.0.7 (1 process)", "torchgpipe")]
        width = max(len(label) for label, _ in rows)
        print(f"{'framework':>{width}}  {'step ms':>9}  {'theirs / gpipe':>14}")
        print(f"{'-' * width}  {'-' * 9}  {'-' * 14}")
        ours = times[name]["gpipe"]
        for label, key in rows:
            if key in times[name]:
                s = times[name][key]
                ratio = "" if key == "gpipe" else f"{s / ours:.2f}"
                print(f"{label:>{width}}  {s * 1e3:>9.2f}  {ratio:>14}")
            else:
                note = torchgpipe_note if key == "torchgpipe" else pipelining_note
                print(f"{label:>{width}}  {'-':>9}  {'-':>14}  ({note})")
    print()
    for name in names:
        ours = times[name]["gpipe"]
        fields = []
        for key in ("pipelining", "torchgpipe"):
            value = times[name].get(key)
            fields.append(f"{key}_over_gpipe=" + (f"{value / ours:.2f}" if value else "nan"))
        print(f"BENCH peer model={name} " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
