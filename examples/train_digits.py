"""Trains an MLP on scikit-learn's digits as a 3-stage gpipe.Pipe; checks it against a plain run.

Run with no arguments (or with the path of the timeline picture to write):

    python examples/train_digits.py [timeline.png]

It prints the loss and test accuracy per epoch of the pipelined model, then
trains the same model plainly (same initial weights, same data order) and
prints OK when the pipelined model reaches at least 95% test accuracy within
2 points of the plain one; otherwise it says what differed and exits 1.
Both run on one intra-op thread (torch.set_num_threads(1)), which the Pipe,
by default, shares out between its stages: one each. It prints both step
times and, when the pipelined run is the slower, why: each cell is
microseconds of math, less than what handing a micro-batch between stages
costs.
It then traces one training step and draws the pipeline's timeline (one row
per stage, a box per micro-batch's forward, recompute and backward) to
timeline.png, printing the measured bubble next to GPipe's ideal.
The data set ships with scikit-learn: nothing is downloaded.
"""
import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Tuple

import torch
from torch import Tensor, nn

import gpipe

EPOCHS = 20
BATCH = 64
CHUNKS = 4
BALANCE = [2, 2, 1]          # three CPU stages
SEED = 0
LR = 1e-3
MIN_ACCURACY = 0.95
MAX_GAP = 0.02

Log = Callable[[str], None]


@dataclass
class Run:
    """One model's training: mean loss per epoch and final test accuracy."""
    name: str
    losses: List[float] = field(default_factory=list)
    accuracies: List[float] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0

    @property
    def accuracy(self) -> float:
        return self.accuracies[-1]


def load_data(seed: int = SEED) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Digits (8x8 images, 10 classes), split 75/25, standardised by the training split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    x_train = torch.tensor(x_train, dtype=torch.float32)
    x_test = torch.tensor(x_test, dtype=torch.float32)
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    return ((x_train - mean) / std, torch.tensor(y_train), (x_test - mean) / std,
            torch.tensor(y_test))


def make_model(seed: int = SEED) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def train(model: nn.Module, name: str, data: Tuple[Tensor, Tensor, Tensor, Tensor],
          epochs: int, log: Log) -> Run:
    """Adam on shuffled mini-batches; the order depends only on SEED."""
    x_train, y_train, x_test, y_test = data
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(SEED)
    run = Run(name)
    start = time.perf_counter()
    for epoch in range(epochs):
        total, seen = 0.0, 0
        for batch in torch.randperm(len(y_train), generator=order).split(BATCH):
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
            seen += len(batch)
            run.steps += 1
        run.losses.append(total / seen)
        run.accuracies.append(accuracy(model, x_test, y_test))
        log(f"{name:>9}  epoch {epoch + 1:2d}/{epochs}  loss {run.losses[-1]:.4f}  "
            f"test accuracy {run.accuracies[-1]:.4f}")
    run.seconds = time.perf_counter() - start
    return run


def compare(epochs: int = EPOCHS, log: Log = print) -> Tuple[Run, Run]:
    """Trains the pipelined model, then the plain one from the same initial weights."""
    # Matrices of 16-64 rows by 128 gain nothing from several intra-op
    # threads and lose to their start-up and spin-waiting (badly on a busy
    # machine), so both runs use one. The Pipe, built under this setting,
    # gives each CPU stage at least one thread of its own (intra_op_threads=0).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = load_data()
        plain = make_model()
        pipe = gpipe.Pipe(copy.deepcopy(plain), balance=BALANCE, chunks=CHUNKS)
        log(f"digits: {len(data[1])} training and {len(data[3])} test images; "
            f"MLP 64-128-128-10 as a Pipe of balance {BALANCE}, {CHUNKS} micro-batches")
        pipelined = train(pipe, "pipelined", data, epochs, log)
        log("same model, same initial weights and data order, without the Pipe:")
        reference = train(plain, "plain", data, epochs, log)
    finally:
        torch.set_num_threads(threads)
    return pipelined, reference


def explain_speed(pipelined: Run, reference: Run, log: Log = print) -> None:
    """Prints both step times and why a model this small gains nothing from a pipeline."""
    if not pipelined.steps or not reference.steps:
        return
    pipe_ms = 1e3 * pipelined.seconds / pipelined.steps
    plain_ms = 1e3 * reference.seconds / reference.steps
    stages = len(BALANCE)
    # Forward and backward of every (stage, micro-batch), plus the recompute
    # of every micro-batch but the last (checkpoint='except_last').
    cells = stages * CHUNKS * 2 + stages * (CHUNKS - 1)
    log(f"speed: pipelined {pipe_ms:.2f} ms per step, plain {plain_ms:.2f} ms per step")
    if pipe_ms <= plain_ms:
        return
    per_cell_us = 1e3 * (pipe_ms - plain_ms) / cells
    log(f"why the pipelined run is {pipe_ms / plain_ms:.1f}x slower: a step runs {cells} cells "
        f"(stage x micro-batch x forward, backward, recompute) of {BATCH // CHUNKS} rows "
        f"through layers of at most 128 features (a 16x128 by 128x128 product is half a "
        f"million multiply-adds: microseconds of math), against "
        f"about {per_cell_us:.0f} us per cell of pipelining cost here (handing micro-batches "
        f"between worker threads; Python layers taking turns on the GIL). A pipeline pays "
        f"off when a cell computes for much longer than that (bench/real.cpp: 2 CPU stages "
        f"of ms-long cells, see docs/benchmarks.md), or when the stages sit on different "
        f"devices.")


def verdict(pipelined: Run, reference: Run, log: Log = print) -> int:
    """0 (printing OK) when the pipelined model is accurate and matches the plain one."""
    gap = abs(pipelined.accuracy - reference.accuracy)
    log(f"test accuracy: pipelined {pipelined.accuracy:.4f} ({pipelined.seconds:.1f} s), "
        f"plain {reference.accuracy:.4f} ({reference.seconds:.1f} s), gap {gap:.4f}")
    explain_speed(pipelined, reference, log)
    failures = []
    if pipelined.accuracy < MIN_ACCURACY:
        failures.append(f"pipelined accuracy {pipelined.accuracy:.4f} < {MIN_ACCURACY}")
    if gap > MAX_GAP:
        failures.append(f"accuracy gap to the plain model {gap:.4f} > {MAX_GAP}")
    if failures:
        log("FAILED: " + "; ".join(failures))
        return 1
    log("OK")
    return 0


def draw_timeline(path: str, log: Log = print) -> None:
    """Traces one training step of the pipelined model and plots it."""
    x, y = load_data()[:2]
    pipe = gpipe.Pipe(make_model(), balance=BALANCE, chunks=CHUNKS)
    pipe(x[:BATCH])  # warm-up, not traced
    with gpipe.tracing(pipe) as trace:
        nn.functional.cross_entropy(pipe(x[:BATCH]), y[:BATCH]).backward()
    log(f"one traced step: {str(trace.summary()).rstrip()}")
    gpipe.plot_timeline(trace, path, title=f"digits MLP, balance {BALANCE}, chunks {CHUNKS}")
    log(f"timeline written to {path}")


def main(epochs: int = EPOCHS, log: Log = print, timeline: str = "timeline.png") -> int:
    pipelined, reference = compare(epochs, log)
    draw_timeline(timeline, log)
    return verdict(pipelined, reference, log)


if __name__ == "__main__":
    sys.exit(main(log=lambda line: print(line, flush=True),
                  timeline=sys.argv[1] if len(sys.argv) > 1 else "timeline.png"))
