"""Trains an MLP as a pipeline over processes (one stage per rank; two under interleaved_1f1b and zb_v) and checks it against the plain model.

Run on one machine with 4 processes (Gloo on CPU):

    torchrun --nproc-per-node 4 examples/train_distributed.py

On several machines, run the same command on each with --nnodes N
--node-rank K --rdzv-endpoint HOST:PORT (see docs/distributed.md). Add
``--dp 2`` to run 2 pipelines of world/2 stages, each stage's grads
averaged over its 2 replicas (pipeline x data parallel).

Every rank builds the same model (same seed) and keeps only its stages'
layers; rank 0 holds the first stage and takes the input, the last
stage's rank takes the target and gets the loss (under zb_v, rank 0 too:
its stages lie in a V). Alongside, every rank
trains the plain nn.Sequential on the whole batch the same way, and after
the last step checks that its own layers' weights equal the plain model's
(float64, to 1e-10). Prints the loss per step on the last stage's rank and
"OK" on every rank when all matched; exits 1 otherwise.
"""
import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import gpipe

STEPS = 5
ROWS = 32
WIDTH = 16
CHUNKS = 4
LAYERS_PER_STAGE = 2


def make_model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for k in range(stages * LAYERS_PER_STAGE):
        layers.append(nn.Linear(WIDTH, WIDTH) if k % 2 == 0 else nn.Tanh())
    return nn.Sequential(*layers).double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--schedule", default="1f1b",
                        help="gpipe, 1f1b (default), interleaved_1f1b, zb_h1 or zb_v")
    args = parser.parse_args()

    if "RANK" not in os.environ:
        print("run me under torchrun, e.g. torchrun --nproc-per-node 4 "
              "examples/train_distributed.py", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.dp != 0:
        raise ValueError(f"--dp {args.dp} does not divide the {world} ranks; pass a divisor")
    stages = world // args.dp
    # Pipeline p holds ranks p*stages .. p*stages+stages-1; stage s's replicas
    # are the ranks s, stages + s, ... (every rank creates every group).
    pipelines = [dist.new_group(list(range(p * stages, (p + 1) * stages)))
                 for p in range(args.dp)]
    replicas = [dist.new_group(list(range(s, world, stages))) for s in range(stages)]
    replica = rank // stages

    # Two stages per rank where the schedule runs them (interleaved: a loop, zb_v: a V).
    per_rank = 2 if args.schedule in ("interleaved_1f1b", "zb_v") else 1
    model = make_model(stages * per_rank)
    plain = copy.deepcopy(model)
    pipe = gpipe.distributed.Pipe(model, [LAYERS_PER_STAGE] * (stages * per_rank),
                                  chunks=CHUNKS, schedule=args.schedule,
                                  virtual_stages=per_rank, group=pipelines[replica],
                                  dp_group=replicas[rank % stages] if args.dp > 1 else None)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        # Every rank draws the same whole batch; each pipeline takes its share.
        x = torch.randn(ROWS * args.dp, WIDTH, generator=generator, dtype=torch.double)
        y = torch.sin(x)
        mine = slice(replica * ROWS, (replica + 1) * ROWS)
        opt.zero_grad()
        loss = pipe.train_step(x[mine] if pipe.is_first else None,
                               target=y[mine] if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        opt.step()
        plain_opt.zero_grad()
        expected = nn.functional.mse_loss(plain(x), y)
        expected.backward()
        plain_opt.step()
        if pipe.is_last and replica == 0:
            print(f"step {step}: loss {loss.item():.6f} (pipeline {args.dp} x "
                  f"{stages * per_rank} stages)", flush=True)

    reference = dict(plain.named_parameters())
    worst = max((p - reference[name]).abs().max().item()
                for name, p in pipe.named_parameters())
    ok = worst <= 1e-10
    print(f"rank {rank}: stages {pipe.stages}, weights differ from the plain model's by at most "
          f"{worst:.2e}: {'OK' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
