"""Trains a pipeline that survives a lost rank: torchrun restarts the job, which resumes from its last checkpoint.

On one machine (Gloo on CPU), with one restart allowed:

    torchrun --nproc-per-node 4 --max-restarts 1 examples/train_restartable.py \
        --dir /tmp/gpipe-run --fail-at-step 3

Every step ends with a torch.distributed.checkpoint (DCP) save of the
model and its AdamW state to DIR/step-K. A save is complete once its
.metadata file exists; DCP writes it last. At start, the job resumes from
the latest complete save, if there is one.

--fail-at-step S makes rank 1 die abruptly in step S, in the first attempt
only (torchrun's TORCHELASTIC_RESTART_COUNT is 0 there), as a lost node
would. The other ranks' step then fails, naming the lost rank, and they
exit. torchrun's agent restarts all four, and the job resumes from step
S - 1's save.

After the last step every rank trains the plain model without a break and
checks that its own layers' weights equal the plain model's (to 1e-12).
It prints "OK" on every rank when all matched, and exits 1 otherwise.
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

LAYERS = 8
STEPS = 6
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


def latest_save(folder: str) -> int:
    """The last step with a complete save in `folder` (-1: none)."""
    done = [int(name.split("-")[1]) for name in os.listdir(folder)
            if name.startswith("step-") and os.path.exists(os.path.join(folder, name,
                                                                        ".metadata"))]
    return max(done, default=-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the checkpoints go")
    parser.add_argument("--fail-at-step", type=int, default=-1,
                        help="rank 1 dies in this step, in the first attempt only")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print("run me under torchrun, e.g. torchrun --nproc-per-node 4 --max-restarts 1 "
              "examples/train_restartable.py --dir /tmp/gpipe-run", file=sys.stderr)
        return 2
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if LAYERS % world != 0:
        raise ValueError(f"{world} ranks cannot split {LAYERS} layers evenly: run 2, 4 or 8")
    os.makedirs(args.dir, exist_ok=True)

    pipe = gpipe.distributed.Pipe(make_model(), [LAYERS // world] * world, chunks=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    # Every rank must resume from the same save: rank 0 picks it.
    picked = torch.tensor([latest_save(args.dir) if rank == 0 else 0])
    dist.broadcast(picked, src=0)
    last = int(picked.item())
    if last >= 0:
        model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
        dcp.load({"model": model_sd, "optim": optim_sd},
                 checkpoint_id=os.path.join(args.dir, f"step-{last}"))
        gpipe.distributed.set_state_dict(pipe, opt, model_state_dict=model_sd,
                                         optim_state_dict=optim_sd)
        if rank == 0:
            print(f"attempt {attempt}: resumed after step {last}", flush=True)

    for step in range(last + 1, STEPS):
        if step == args.fail_at_step and attempt == 0 and rank == 1:
            print(f"rank 1: dying in step {step} (attempt {attempt})", flush=True)
            os._exit(1)
        x, y = batch(step)
        opt.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        opt.step()
        model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
        dcp.save({"model": model_sd, "optim": optim_sd},
                 checkpoint_id=os.path.join(args.dir, f"step-{step}"))
        if pipe.is_last:
            print(f"attempt {attempt} step {step}: loss {loss.item():.6f}", flush=True)

    plain = make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = batch(step)
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    reference = dict(plain.named_parameters())
    worst = max((p - reference[name]).abs().max().item() for name, p in pipe.named_parameters())
    ok = worst <= 1e-12
    print(f"rank {rank}: attempt {attempt}, weights differ from the plain model trained without "
          f"a break by at most {worst:.2e}: {'OK' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
