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

Schedules (the step inside the pipeline): gpipe's `pipe.train_step(x, y, loss_fn)`
with schedule='gpipe', '1f1b', 'interleaved_1f1b' (virtual_stages=2), 'zb_h1'
and 'zb_v' (2 stages per device in a V) (one process, 4 CPU stages) against torch.distributed.pipelining's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble (2 stages per rank, stage s on rank s mod 4),
ScheduleZBVZeroBubble and ScheduleDualPipeV (2 stages per rank in a V: rank
r holds stages r and 7 - r), each schedule in its own group of 4 processes
(Gloo), so one that crashes or hangs costs only its own row (its error is
reported). Models, 8 layers each so every schedule can cut them into 4 or 8
stages:
  sim   8 split sleep layers (forward t/2 = 1 ms, backward t: t/2 for the
        input's grad and t/2 for the weight's, each only when the running
        backward computes it, so a zero-bubble split pays each half once):
        a 4-stage cut has sim's costs (forward t, backward 2t per stage).
  tiny  the tiny model above.
loss = output.sum() on both sides (timing only). The BENCH lines
`BENCH peer model=... schedule=... pipelining_over_gpipe=...` compare
like with like: gpipe, 1f1b, interleaved_1f1b and zb_v against theirs of
the same name (zb_v: ScheduleZBVZeroBubble); zb_h1 has no like in pipelining
(theirs are interleaved or V-shaped) and is only in the table.

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


class SplitSleepFn(torch.autograd.Function):
    """Identity whose forward sleeps t and whose backward sleeps t for the
    input's grad and t for the weight's, each only when the running backward
    will use it (ctx.needs_input_grad is fixed at forward in Python; the
    engine's plan for the running pass is asked instead, through the view
    nodes that `SplitSleep` puts in front of both inputs)."""

    @staticmethod
    def forward(ctx, x, w, t):  # type: ignore[override]
        ctx.t = t
        time.sleep(t)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        def runs(i: int) -> bool:
            node = ctx.next_functions[i][0]
            return node is not None and torch._C._will_engine_execute_node(node)

        want_x, want_w = runs(0), runs(1)
        time.sleep(ctx.t * (want_x + want_w))
        # contiguous, like a real layer's input grad: pipelining's zero-bubble schedules send
        # autograd.grad's result as it is, and Gloo refuses sum()'s expanded grad.
        return (grad.contiguous() if want_x else None), (torch.zeros(1) if want_w else None), None


class SplitSleep(nn.Module):
    """A split sleep layer; the views make both inputs' next nodes non-leaf
    nodes, which `_will_engine_execute_node` can be asked about under
    autograd.grad too (a leaf's AccumulateGrad cannot)."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return SplitSleepFn.apply(x.view_as(x), self.w.view_as(self.w), self.t)


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


# ---- schedules: train_step against pipelining's schedules ---------------------------------------

# gpipe's schedule name, its virtual stages, and pipelining's schedule of the same name (if any).
GPIPE_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2)]
# pipelining's schedule class, its stage placement ("one": stage = rank; "loop": ranks r and
# r + K; "v": r and 2K - 1 - r), and gpipe's schedule it is compared with in the BENCH lines.
PIPELINING_SCHEDULES = [
    ("ScheduleGPipe", "one", "gpipe"),
    ("Schedule1F1B", "one", "1f1b"),
    ("ScheduleInterleaved1F1B", "loop", "interleaved_1f1b"),
    ("ScheduleInterleavedZeroBubble", "loop", None),
    ("ScheduleZBVZeroBubble", "v", "zb_v"),
    ("ScheduleDualPipeV", "v", None),
]


def make_schedule_model(name: str, t: float) -> nn.Sequential:
    """8 layers: split sleep layers of t/2 for sim, the tiny model for tiny."""
    torch.manual_seed(0)
    if name == "sim":
        return nn.Sequential(*[SplitSleep(t / 2) for _ in range(2 * K)])
    return make_model(name, t)


def time_gpipe_train(name: str, cfg: dict, schedule: str, v: int) -> float:
    import gpipe

    model = make_schedule_model(name, cfg["t"])
    stages = K * v
    pipe = gpipe.Pipe(model, balance=[len(model) // stages] * stages, devices=["cpu"] * K,
                      chunks=cfg["m"], checkpoint="never", schedule=schedule, virtual_stages=v)
    x = make_input(name, cfg["m"])
    target = torch.zeros(x.shape[0], 1)
    return time_blocks(lambda: pipe.train_step(x, target, lambda out, y: out.sum()), cfg)


def stage_indices(placement: str, rank: int) -> list:
    if placement == "one":
        return [rank]
    if placement == "loop":
        return [rank, rank + K]
    return [rank, 2 * K - 1 - rank]


def pipelining_step(schedule_name: str, placement: str, rank: int, name: str, cfg: dict,
                    group=None):
    """One training step of torch.distributed.pipelining's `schedule_name` on this rank's
    stages (`placement`, as stage_indices) of the 8-layer schedule model, loss =
    output.sum(), over `group` (None: the default group). Made here, it fails (or hangs) only
    when run."""
    import torch.distributed.pipelining as pipelining

    model = make_schedule_model(name, cfg["t"])
    indices = stage_indices(placement, rank)
    n_stages = K if placement == "one" else 2 * K
    per = len(model) // n_stages
    stages = [pipelining.PipelineStage(nn.Sequential(*list(model)[i * per:(i + 1) * per]),
                                       i, n_stages, torch.device("cpu"), group=group)
              for i in indices]
    cls = getattr(pipelining, schedule_name)
    schedule = cls(stages[0] if placement == "one" else stages, n_microbatches=cfg["m"],
                   loss_fn=lambda out, target: out.sum(), scale_grads=False)
    x = make_input(name, cfg["m"])
    target = torch.zeros(1)
    first, last = 0 in indices, n_stages - 1 in indices

    def step():
        kwargs = dict(target=target, losses=[]) if last else {}
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)

    return step


def pipelining_schedule_worker(rank: int, port: int, schedule_name: str, placement: str,
                               names: list, quick: bool, result_path: str) -> None:
    import torch.distributed as dist

    set_timer_slack()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=K)
    try:
        results = {}
        for name in names:
            cfg = config(name, quick)
            step = pipelining_step(schedule_name, placement, rank, name, cfg)
            results[name] = time_blocks(step, cfg, sync=dist.barrier)
            if rank == 0:  # after each model: a later model's failure keeps this one's time
                with open(result_path, "w") as f:
                    json.dump(results, f)
    except BaseException as e:
        # The first line of what went wrong, for the table; the traceback still goes to stderr.
        with open(f"{result_path}.err{rank}", "w") as f:
            f.write(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        raise
    finally:
        dist.destroy_process_group()


def time_pipelining_schedule(schedule_name: str, placement: str, names: list, quick: bool,
                             timeout: float) -> tuple:
    """({model: seconds}, failure): the models timed before any failure, and the first
    failing rank's error (or a timeout), None when all ran."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        context = mp.spawn(pipelining_schedule_worker,
                           args=(free_port(), schedule_name, placement, names, quick, path),
                           nprocs=K, join=False)
        deadline = time.monotonic() + timeout
        failure = None
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    failure = f"no result after {timeout:.0f} s (hung); killed"
                    break
        except Exception as e:  # a rank failed; spawn has stopped the others
            failure = f"{type(e).__name__}"
            print(f"peer: pipelining {schedule_name}: {e}", file=sys.stderr)
        if failure is not None:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            # The first rank to fail names the cause; the others then lose their peers.
            errors = sorted((f for f in os.listdir(tmp) if ".err" in f),
                            key=lambda f: os.path.getmtime(os.path.join(tmp, f)))
            if errors:
                with open(os.path.join(tmp, errors[0])) as f:
                    failure = f"rank {errors[0].rsplit('err', 1)[1]}: {f.read()}"
        done = {}
        if os.path.exists(path):
            with open(path) as f:
                done = json.load(f)
        return done, failure


def run_schedules(names: list, quick: bool) -> tuple:
    """gpipe's train_step times, pipelining's times and pipelining's failures."""
    ours = {name: {} for name in names}
    for name in names:
        cfg = config(name, quick)
        for schedule, v in GPIPE_SCHEDULES:
            ours[name][schedule] = time_gpipe_train(name, cfg, schedule, v)
    theirs = {name: {} for name in names}
    failures = {name: {} for name in names}
    for schedule_name, placement, _ in PIPELINING_SCHEDULES:
        # tiny first: sim's Python autograd.Function breaks a schedule that tiny runs.
        done, failure = time_pipelining_schedule(schedule_name, placement, sorted(names,
                                                 key=lambda n: n != "tiny"), quick,
                                                 timeout=120)
        for name in names:
            if name in done:
                theirs[name][schedule_name] = done[name]
            else:
                failures[name][schedule_name] = failure
        if failure:
            print(f"peer: pipelining {schedule_name} failed: {failure}", file=sys.stderr)
    return ours, theirs, failures


def report_schedules(names: list, quick: bool, ours: dict, theirs: dict, failures: dict) -> list:
    """Prints the schedules' tables; returns their BENCH lines."""
    lines = []
    for name in names:
        cfg = config(name, quick)
        what = (f"8 split sleep layers of t/2 = {cfg['t'] * 1e3 / 2:g} ms (a 4-stage cut: forward "
                f"t, backward 2t per stage), M={cfg['m']}; 1f1b's bound "
                f"{(cfg['m'] + K - 1) * 3 * cfg['t'] * 1e3:.0f} ms, perfect "
                f"{cfg['m'] * 3 * cfg['t'] * 1e3:.0f} ms"
                if name == "sim" else f"{2 * K} x Linear(16, 16), batch 64, M={cfg['m']}")
        print(f"\nschedules, model {name}: {what}; train_step / schedule.step, median over "
              f"{cfg['blocks']} blocks of {cfg['per_block']} steps after {cfg['warmup']} warm-up")
        base = ours[name]["1f1b"]
        rows = [(f"gpipe train_step {s}" + (f" (v={v})" if v > 1 else ""), ours[name][s], None)
                for s, v in GPIPE_SCHEDULES]
        for schedule_name, _, like in PIPELINING_SCHEDULES:
            rows.append((f"pipelining {schedule_name}", theirs[name].get(schedule_name),
                         failures[name].get(schedule_name)))
        width = max(len(label) for label, _, _ in rows)
        print(f"{'schedule':>{width}}  {'step ms':>9}  {'this / gpipe 1f1b':>17}")
        print(f"{'-' * width}  {'-' * 9}  {'-' * 17}")
        for label, seconds, failure in rows:
            if seconds is None:
                print(f"{label:>{width}}  {'-':>9}  {'-':>17}  (failed: {failure})")
            else:
                print(f"{label:>{width}}  {seconds * 1e3:>9.2f}  {seconds / base:>17.2f}")
        for schedule_name, _, like in PIPELINING_SCHEDULES:
            if like is None:
                continue
            value = theirs[name].get(schedule_name)
            ratio = f"{value / ours[name][like]:.2f}" if value else "nan"
            lines.append(f"BENCH peer model={name} schedule={like} pipelining_over_gpipe={ratio}")
    # 1f1b first: the headline.
    lines.sort(key=lambda line: "schedule=1f1b " not in line)
    return lines


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
    schedules = run_schedules(names, quick)

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
    schedule_lines = report_schedules(names, quick, *schedules)
    print()
    for name in names:
        ours = times[name]["gpipe"]
        fields = []
        for key in ("pipelining", "torchgpipe"):
            value = times[name].get(key)
            fields.append(f"{key}_over_gpipe=" + (f"{value / ours:.2f}" if value else "nan"))
        print(f"BENCH peer model={name} " + " ".join(fields))
    for line in schedule_lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
