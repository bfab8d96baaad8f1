# gpu.py — gpipe on one GPU: two stages on separate streams against the plain model, checkpoint memory, the traced bubble.
"""Step time and peak memory of gpipe.Pipe on one CUDA device.

    python3 bench/gpu.py [--quick]

Without a CUDA device it prints "skipped: no CUDA" and exits 0.

(i) Overlap on one GPU. An MLP of 16 x (Linear(8192, 8192) + ReLU), float32,
    batch 4096, as the plain nn.Sequential and as a Pipe of 2 stages (8 pairs
    each) both on cuda:0, M = 8 micro-batches, checkpoint 'never' (so only the
    pipeline itself differs). The GPU is busy either way; the ratio says what
    cutting the batch and running two streams costs (or gains) on one device.
(ii) Checkpoint memory. 32 x (Linear(4096, 4096) + ReLU), batch 8192, 4
    stages on cuda:0, M = 8, for checkpoint 'always', 'except_last' and
    'never': the peak of torch.cuda.max_memory_allocated over one training
    step, above what was allocated when the step began (parameters, their
    grads, cuBLAS workspaces: all made by an untimed warm-up step), and the
    median step time.
(iii) The trace on a GPU. 8 x (Linear(4096, 4096) + ReLU), batch 4096, 4
    stages on cuda:0, M = 8, checkpoint 'never': one traced step's measured
    bubble against GPipe's (K-1)/(M+K-1). The cells are timed by device
    events, so busy time is the device's; with all stages sharing one GPU
    their kernels may run at once, so busy times can overlap and the
    measured bubble can fall below the ideal (timed on the host, as before,
    cells would last only as long as queueing their kernels, and the bubble
    would sit near 1).

A step is forward, loss = output.mean(), backward; each is timed between two
torch.cuda.synchronize() calls, and the median of the timed steps is
reported. The last lines are

    BENCH gpu device="<name>" pipe_over_plain=<ratio> plain_s=<s> pipe_s=<s>
    BENCH gpu_memory always_over_never=<ratio> time_always_over_never=<ratio> ...
    BENCH gpu_trace bubble=<measured> ideal_bubble=<ideal> busy_over_span=<ratio>

About a minute on an H200; --quick shrinks every size for a smoke run.
"""
import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
from torch import nn


def mlp(pairs: int, width: int) -> nn.Sequential:
    """pairs x (Linear(width, width), ReLU), float32, on the CPU."""
    layers: List[nn.Module] = []
    for _ in range(pairs):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def timed_steps(step: Callable[[], None], warmup: int, reps: int) -> List[float]:
    """Seconds per step for `reps` steps after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def training_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(x).mean().backward()
    return step


def table(header: List[str], rows: List[List[str]]) -> None:
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    line = lambda r: "  ".join(cell.rjust(w) for cell, w in zip(r, widths))  # noqa: E731
    print(line(header))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))


def overlap(gpipe, quick: bool) -> Dict[str, float]:
    """(i): the plain model and a 2-stage Pipe on one GPU; median step seconds."""
    pairs, width, batch, chunks = (4, 1024, 512, 8) if quick else (16, 8192, 4096, 8)
    warmup, reps = (1, 3) if quick else (2, 5)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    x = torch.randn(batch, width, device=device)

    plain = mlp(pairs, width).to(device)
    plain_s = statistics.median(timed_steps(training_step(plain, x), warmup, reps))
    del plain
    torch.cuda.empty_cache()

    pipe = gpipe.Pipe(mlp(pairs, width), balance=[pairs, pairs], devices=[device, device],
                      chunks=chunks, checkpoint="never")
    pipe_s = statistics.median(timed_steps(training_step(pipe, x), warmup, reps))
    del pipe
    torch.cuda.empty_cache()

    print(f"(i) {pairs} x (Linear({width}, {width}) + ReLU), float32, batch {batch}; "
          f"Pipe: 2 stages on cuda:0, M = {chunks}, checkpoint never")
    table(["model", "step ms", "vs plain"],
          [["plain", f"{plain_s * 1e3:.1f}", "1.00"],
           ["pipe", f"{pipe_s * 1e3:.1f}", f"{pipe_s / plain_s:.2f}"]])
    return {"plain_s": plain_s, "pipe_s": pipe_s}


def memory(gpipe, quick: bool) -> Dict[str, Dict[str, float]]:
    """(ii): peak bytes above the step's start and median step seconds, per mode."""
    pairs, width, batch, chunks = (8, 256, 2048, 4) if quick else (32, 4096, 8192, 8)
    warmup, reps = 1, (2 if quick else 3)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    x = torch.randn(batch, width, device=device)
    stages = 4
    results: Dict[str, Dict[str, float]] = {}
    for mode in ["always", "except_last", "never"]:
        pipe = gpipe.Pipe(mlp(pairs, width), balance=[2 * pairs // stages] * stages,
                          devices=[device] * stages, chunks=chunks, checkpoint=mode)
        step = training_step(pipe, x)
        seconds = statistics.median(timed_steps(step, warmup, reps))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize()
        results[mode] = {"peak": torch.cuda.max_memory_allocated(device) - before,
                         "total": torch.cuda.max_memory_allocated(device), "s": seconds}
        del pipe, step
        torch.cuda.empty_cache()

    never = results["never"]
    print(f"(ii) {pairs} x (Linear({width}, {width}) + ReLU), float32, batch {batch}; "
          f"Pipe: {stages} stages on cuda:0, M = {chunks}")
    table(["checkpoint", "peak MiB", "vs never", "total MiB", "step ms", "vs never"],
          [[mode, f"{r['peak'] / 2**20:.0f}", f"{r['peak'] / never['peak']:.2f}",
            f"{r['total'] / 2**20:.0f}", f"{r['s'] * 1e3:.1f}", f"{r['s'] / never['s']:.2f}"]
           for mode, r in results.items()])
    return results


def traced(gpipe, quick: bool) -> Dict[str, float]:
    """(iii): one traced step of 4 stages on cuda:0; the measured bubble against the ideal."""
    pairs, width, batch, chunks = (4, 256, 1024, 8) if quick else (8, 4096, 4096, 8)
    stages = 4
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    x = torch.randn(batch, width, device=device)
    pipe = gpipe.Pipe(mlp(pairs, width), balance=[2 * pairs // stages] * stages,
                      devices=[device] * stages, chunks=chunks, checkpoint="never")
    step = training_step(pipe, x)
    step()  # warm-up: cuBLAS per stream, the allocator
    torch.cuda.synchronize()
    with gpipe.tracing(pipe) as trace:
        step()
    summary = trace.summary()
    busy = sum(summary.busy_us) / stages
    del pipe, step
    torch.cuda.empty_cache()
    print(f"(iii) {pairs} x (Linear({width}, {width}) + ReLU), float32, batch {batch}; "
          f"Pipe: {stages} stages on cuda:0, M = {chunks}, one traced step (device-timed cells)")
    print(str(summary).rstrip())
    return {"bubble": summary.bubble, "ideal": summary.ideal_bubble,
            "busy_over_span": busy / summary.span_us if summary.span_us > 0 else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    try:
        import gpipe
    except ImportError as e:
        print(f"bench/gpu.py: cannot import gpipe ({e}); install it first: "
              f"pip install --no-build-isolation --no-deps . (see tests/gpu/run.sh)",
              file=sys.stderr)
        return 1

    name = torch.cuda.get_device_name(0)
    print(f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    start = time.perf_counter()
    o = overlap(gpipe, args.quick)
    print()
    m = memory(gpipe, args.quick)
    print()
    t = traced(gpipe, args.quick)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    print(f'BENCH gpu device="{name}" pipe_over_plain={o["pipe_s"] / o["plain_s"]:.3f} '
          f'plain_s={o["plain_s"]:.4f} pipe_s={o["pipe_s"]:.4f}')
    always, except_last, never = m["always"], m["except_last"], m["never"]
    print(f"BENCH gpu_memory always_over_never={always['peak'] / never['peak']:.3f} "
          f"time_always_over_never={always['s'] / never['s']:.3f} "
          f"except_last_over_never={except_last['peak'] / never['peak']:.3f} "
          f"never_peak_mib={never['peak'] / 2**20:.0f}")
    print(f"BENCH gpu_trace bubble={t['bubble']:.3f} ideal_bubble={t['ideal']:.3f} "
          f"busy_over_span={t['busy_over_span']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
