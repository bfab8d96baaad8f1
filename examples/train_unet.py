"""A small U-Net, its skips crossing stages, trained with gpipe.Pipe.train_step on 4 CPU stages.

Run with no arguments (or ask for a timeline picture):

    python examples/train_unet.py [--timeline timeline_unet.png]

The model denoises synthetic 16x16 images (a few bright squares on black,
plus noise). Its two "down" blocks stash their input (``@skippable``,
``yield stash('skip', x)``) and the matching "up" blocks pop it and join
it to their upsampled input, last in, first out; the two skips share the
name 'skip' in two ``Namespace``s. Under balance [2, 1, 2, 2] the outer
skip goes from stage 0 straight to stage 3 and the inner one from stage 1
to stage 2: the engine sends each from the stage that stashes it to the
stage that pops it, and its grad straight back.

It checks itself:

1. one ``train_step`` (schedule '1f1b', 4 micro-batches) of a float64 copy
   gives the loss and every parameter grad of
   ``mse_loss(model(x), y).backward()`` on the plain model, to 1e-10;
2. training (float32, Adam) for a few dozen steps brings the loss down to
   under half its first value, and under half the loss of answering all
   black (which already beats the noisy input itself): it learned to see
   the squares.

It prints what it checked, then OK, or FAILED and what failed (exit 1).
With ``--timeline PATH`` it also traces one training step and draws it.
"""
import argparse
import copy
import sys
import time
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gpipe
from gpipe.skip import Namespace, pop, skippable, stash

Log = Callable[[str], None]

BALANCE = [2, 1, 2, 2]   # the outer skip: stage 0 -> 3; the inner one: stage 1 -> 2
CHUNKS = 4
SCHEDULE = "1f1b"
SIZE = 16                # images are SIZE x SIZE, one channel
BATCH = 16
STEPS = 40
LR = 0.01
TOL = 1e-10              # the float64 step against the plain model
LEARNED = 0.5            # the loss must fall under this fraction of its first value


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stashes its input for the matching Up, then halves the resolution."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, out, 3, padding=1)

    def forward(self, x):
        yield stash("skip", x)
        return F.relu(self.conv(F.avg_pool2d(x, 2)))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Doubles the resolution and joins the features its Down stashed."""

    def __init__(self, channels: int, skip: int, out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels + skip, out, 3, padding=1)

    def forward(self, x):
        skip = yield pop("skip")
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        return F.relu(self.conv(torch.cat([x, skip], dim=1)))


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU()),    # 0  16x16
        Down(8, 16).isolate(outer),                                 # 1  -> 8x8, stashes 16x16
        Down(16, 16).isolate(inner),                                # 2  -> 4x4, stashes 8x8
        nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()),  # 3  4x4
        Up(16, 16, 16).isolate(inner),                              # 4  -> 8x8
        Up(16, 8, 8).isolate(outer),                                # 5  -> 16x16
        nn.Conv2d(8, 1, 1),                                         # 6
    )


def make_batch(generator: torch.Generator, rows: int = BATCH) -> Tuple[Tensor, Tensor]:
    """Noisy images and their clean originals: 1 to 3 bright squares each."""
    clean = torch.zeros(rows, 1, SIZE, SIZE)
    for i in range(rows):
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            side = int(torch.randint(3, 7, (1,), generator=generator))
            r, c = torch.randint(0, SIZE - side, (2,), generator=generator).tolist()
            clean[i, 0, r:r + side, c:c + side] = 1.0
    noisy = clean + 0.4 * torch.randn(clean.shape, generator=generator)
    return noisy, clean


def make_pipe(model: nn.Sequential) -> gpipe.Pipe:
    return gpipe.Pipe(model, balance=BALANCE, devices="cpu", chunks=CHUNKS, schedule=SCHEDULE)


def check_grads(log: Log = print) -> float:
    """One train_step of a float64 copy against the plain model: the largest difference in
    the loss and the parameter grads."""
    model = make_model().double()
    reference = copy.deepcopy(model)
    pipe = make_pipe(model)
    x, y = make_batch(torch.Generator().manual_seed(1))
    x, y = x.double(), y.double()
    loss = pipe.train_step(x, y, F.mse_loss)
    want = F.mse_loss(reference(x), y)
    want.backward()
    error = abs(loss.item() - want.item())
    for (name, got), ref in zip(pipe.named_parameters(), reference.parameters()):
        if got.grad is None or ref.grad is None:
            raise AssertionError(f"{name}: a grad is missing (Pipe {got.grad is not None}, "
                                 f"plain {ref.grad is not None})")
        error = max(error, (got.grad - ref.grad).abs().max().item())
    log(f"check 1: one float64 train_step (schedule '{SCHEDULE}', {CHUNKS} micro-batches, "
        f"balance {BALANCE}) vs the plain model: max |diff| {error:.1e} (loss and "
        f"{len(list(reference.parameters()))} grads; must be <= {TOL:.0e})")
    return error


class Run(NamedTuple):
    losses: List[float]
    seconds: float
    #: The loss of answering all black on the same batches (a model that learned nothing).
    black: float


def train(steps: int = STEPS, log: Log = print) -> Run:
    """Trains the pipelined model (float32, Adam) on fresh synthetic batches."""
    pipe = make_pipe(make_model())
    opt = torch.optim.Adam(pipe.parameters(), lr=LR)
    data = torch.Generator().manual_seed(2)
    losses: List[float] = []
    black: List[float] = []
    start = time.perf_counter()
    for step in range(steps):
        x, y = make_batch(data)
        black.append(F.mse_loss(torch.zeros_like(y), y).item())
        opt.zero_grad()
        losses.append(pipe.train_step(x, y, F.mse_loss).item())
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:3d}: loss {losses[-1]:.4f}")
    return Run(losses, time.perf_counter() - start, sum(black) / len(black))


def verdict(error: float, run: Run, log: Log = print) -> int:
    """OK (0) when the step matched the plain model and the loss fell; else FAILED (1)."""
    first, last = run.losses[0], sum(run.losses[-5:]) / len(run.losses[-5:])
    log(f"check 2: training loss {first:.4f} -> {last:.4f} (mean of the last 5 steps) in "
        f"{run.seconds:.1f} s; must be < {LEARNED} x the first and < {LEARNED} x all black's "
        f"{run.black:.4f}")
    failures = []
    if not error <= TOL:
        failures.append(f"the pipelined step differs from the plain model by {error:.3e}")
    if not last < LEARNED * first:
        failures.append(f"the loss did not fall enough: {first:.4f} -> {last:.4f}")
    if not last < LEARNED * run.black:
        failures.append(f"the loss {last:.4f} is not under {LEARNED} x that of answering all "
                        f"black ({run.black:.4f}): the model did not learn the squares")
    if failures:
        log("FAILED: " + "; ".join(failures))
        return 1
    log("OK")
    return 0


def draw_timeline(path: str, log: Log = print) -> None:
    """Traces one training step of the pipelined model and plots it."""
    pipe = make_pipe(make_model())
    x, y = make_batch(torch.Generator().manual_seed(3))
    pipe.train_step(x, y, F.mse_loss)  # warm-up, not traced
    with gpipe.tracing(pipe) as trace:
        pipe.train_step(x, y, F.mse_loss)
    log(f"one traced step: {str(trace.summary()).rstrip()}")
    gpipe.plot_timeline(trace, path, title=f"U-Net, train_step '{SCHEDULE}', balance "
                                           f"{BALANCE}, chunks {CHUNKS}")
    log(f"timeline written to {path}")


def main(argv: Optional[List[str]] = None, log: Log = print, steps: int = STEPS) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeline", metavar="PATH",
                        help="also trace one training step and draw it to PATH (PNG)")
    args = parser.parse_args(argv)
    log(f"U-Net on {len(BALANCE)} CPU stages, balance {BALANCE}: skips stage 0 -> 3 and "
        f"stage 1 -> 2")
    error = check_grads(log)
    run = train(steps, log)
    if args.timeline:
        draw_timeline(args.timeline, log)
    return verdict(error, run, log)


if __name__ == "__main__":
    sys.exit(main(log=lambda line: print(line, flush=True)))
