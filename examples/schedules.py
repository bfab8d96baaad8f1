"""One train_step per schedule on simulated devices; each checked against the plain model, timed, drawn.

Run with no arguments (or with a folder to draw the timelines into):

    python examples/schedules.py [folder]

The model: 8 layers on 4 CPU stages (interleaved_1f1b and zb_v: 8 stages, 2
per worker; zb_v's in a V, worker w running stages w and 7 - w), each layer a simulated device kernel: its forward sleeps t, the
grad of its input another t (I) and the grad of its weight another t (W),
so a backward takes 2t and zero bubble can run its two halves apart. A
sleeping thread holds no core, so four "devices" run at once even on two
cores. For each schedule it runs one train_step with 8 micro-batches,
checks the loss and every grad against the plain Sequential (float64, to
1e-10), and prints the step's measured time next to the schedule's ideal
(from the plan's simulation with the same costs). It prints OK when every
schedule matched the plain model and zb_h1 beat gpipe's step time;
otherwise what differed, and exits 1. With a folder, it draws each step's
timeline there as timeline_<schedule>.png (one row per worker).
"""
import copy
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

import gpipe

T = 0.004          # seconds: one forward, and each half of a backward
WORKERS = 4
MICROBATCHES = 8
ROWS = 16
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"]
# The schedules' ideal step (README, "train_step"), a stage being 2 layers
# (F = I = W = 2t; interleaved: 2 stages of one layer per worker):
# gpipe, 1f1b: (M + K - 1)(F + B); interleaved (v = 2): M(F + B) + (K - 1)(F + B)/2;
# zb_h1: M(F + I + W) + (K - 1)(F + I - W); zb_v (stages of one layer, F = I = W = t): its
# plan's simulate() (csrc/plan.h), 51 t for 4 workers and 8 micro-batches.
IDEAL = {
    "gpipe": (MICROBATCHES + WORKERS - 1) * 3 * T * 2,
    "1f1b": (MICROBATCHES + WORKERS - 1) * 3 * T * 2,
    "interleaved_1f1b": (MICROBATCHES * 3 + (WORKERS - 1) * 3 / 2) * T * 2,
    "zb_h1": (MICROBATCHES * 3 + (WORKERS - 1)) * T * 2,
    "zb_v": 51 * T,
}


class _Nap(torch.autograd.Function):
    """Identity that sleeps `seconds` in forward (when asked) and in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        if forward_s:
            time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """y = nap(x) * nap(w): forward t; the input's grad (through the first nap) t, the
    weight's grad (through the second) t, computed apart when the schedule splits them."""

    def __init__(self, features: int, t: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.9, 1.1, features, dtype=torch.float64))
        self.t = t

    def forward(self, x: Tensor) -> Tensor:
        return _Nap.apply(x, self.t, self.t) * _Nap.apply(self.weight, 0.0, self.t)


def make_model(t: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[SleepLayer(4, t) for _ in range(2 * WORKERS)])


def one_step(schedule: str, t: float, plot_dir: Optional[Path]) -> Dict[str, float]:
    """One checked, timed train_step with `schedule`; its seconds and grad error."""
    model = make_model(t)
    reference = copy.deepcopy(model)
    v = 2 if schedule in ("interleaved_1f1b", "zb_v") else 1
    balance = [2 // v] * (WORKERS * v)
    pipe = gpipe.Pipe(model, balance, devices=["cpu"] * WORKERS, chunks=MICROBATCHES,
                      checkpoint="never", schedule=schedule, virtual_stages=v)
    x = torch.randn(ROWS, 4, dtype=torch.float64)
    y = torch.randn(ROWS, 4, dtype=torch.float64)
    pipe.train_step(x, y, nn.functional.mse_loss)  # warm-up
    pipe.zero_grad()
    with gpipe.tracing(pipe) as trace:
        start = time.perf_counter()
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        seconds = time.perf_counter() - start
    want = nn.functional.mse_loss(reference(x), y)
    want.backward()
    error = abs(loss.item() - want.item())
    for got, ref in zip(pipe.parameters(), reference.parameters()):
        error = max(error, (got.grad - ref.grad).abs().max().item())
    if plot_dir is not None:
        gpipe.plot_timeline(trace, plot_dir / f"timeline_{schedule}.png", by="thread",
                            title=f"train_step, schedule='{schedule}': {WORKERS} workers, "
                                  f"{MICROBATCHES} micro-batches")
    return {"seconds": seconds, "error": error}


def main(argv: List[str]) -> int:
    plot_dir = Path(argv[1]) if len(argv) > 1 else None
    if plot_dir is not None:
        plot_dir.mkdir(parents=True, exist_ok=True)
    results = {s: one_step(s, T, plot_dir) for s in SCHEDULES}
    print(f"{WORKERS} workers, {MICROBATCHES} micro-batches, t = {T * 1e3:.0f} ms "
          f"(forward t, backward 2t):")
    ok = True
    for s, r in results.items():
        ideal = IDEAL[s]
        print(f"  {s:17s} step {r['seconds'] * 1e3:6.1f} ms (ideal {ideal * 1e3:6.1f} ms), "
              f"max |diff| vs plain {r['error']:.1e}")
        if not r["error"] <= 1e-10:
            print(f"  {s}: differs from the plain model by {r['error']:.3e}")
            ok = False
    if not results["zb_h1"]["seconds"] < results["gpipe"]["seconds"]:
        print("  zb_h1 was not faster than gpipe")
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
