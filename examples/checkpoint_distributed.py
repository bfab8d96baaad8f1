"""Saves a pipeline's training state on some ranks and resumes it on others, with another balance.

On one machine (Gloo on CPU), save after 3 steps on 4 ranks, then resume
for 3 more on 2:

    torchrun --nproc-per-node 4 examples/checkpoint_distributed.py --save /tmp/gpipe-ckpt
    torchrun --nproc-per-node 2 examples/checkpoint_distributed.py --resume /tmp/gpipe-ckpt

The model (12 layers: Linear and Tanh in turn, float64) is split evenly
over however many ranks run it (2, 3, 4, 6 or 12). The model and its AdamW
state go through torch.distributed.checkpoint (DCP), with
gpipe.distributed.get_state_dict / set_state_dict. Those are torch's
functions, with the optimizer state flattened so that it loads on another
layout. After resuming, every rank trains the plain model for all 6 steps
without a break and checks that its own layers' weights equal the plain
model's (to 1e-12). It prints "OK" on every rank when all matched, and
exits 1 otherwise.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import gpipe.distributed

LAYERS = 12
STEPS = 3  # before the save, and again after the resume
ROWS = 16
WIDTH = 8


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) if k % 2 == 0 else nn.Tanh()
                           for k in range(LAYERS)]).double()


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.double)
    return x, torch.sin(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="DIR", help="train 3 steps, then save to DIR")
    mode.add_argument("--resume", metavar="DIR", help="load DIR, then train 3 more steps")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print("run me under torchrun, e.g. torchrun --nproc-per-node 4 "
              "examples/checkpoint_distributed.py --save /tmp/gpipe-ckpt", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if LAYERS % world != 0:
        raise ValueError(f"{world} ranks cannot split {LAYERS} layers evenly: run 2, 3, 4, 6 "
                         f"or 12 processes")

    pipe = gpipe.distributed.Pipe(make_model(), [LAYERS // world] * world, chunks=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    first = 0
    if args.resume:
        model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.resume)
        gpipe.distributed.set_state_dict(pipe, opt, model_state_dict=model_sd,
                                         optim_state_dict=optim_sd)
        first = STEPS
    for step in range(first, first + STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        opt.step()
        if pipe.is_last:
            print(f"step {step}: loss {loss.item():.6f} ({world} ranks)", flush=True)

    if args.save:
        model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.save)
        print(f"rank {rank}: saved stages {pipe.stages} to {args.save}", flush=True)
        dist.destroy_process_group()
        return 0

    plain = make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    for step in range(2 * STEPS):
        x, y = batch(step)
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    reference = dict(plain.named_parameters())
    worst = max((p - reference[name]).abs().max().item() for name, p in pipe.named_parameters())
    ok = worst <= 1e-12
    print(f"rank {rank}: stages {pipe.stages}, weights differ from the plain model trained "
          f"without a break by at most {worst:.2e}: {'OK' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
