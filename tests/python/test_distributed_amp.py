"""Loss scaling across a pipeline's ranks: gpipe.distributed.grad_scaler (torch's
ShardedGradScaler over the pipe's group) scales every micro-batch's loss, unscales, and skips the
optimizer step on every rank when any rank found an inf or a nan.

The tied GPT of test_distributed_ranks on 4 Gloo processes (float64: the scaler's logic does not
depend on fp16, and the plain model is the reference). Each test spawns this file as worker
processes (test_distributed's ``_spawn``).
"""
import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402
from test_distributed_ranks import SEQ, VOCAB, _gpt, _loss  # noqa: E402

INIT_SCALE = 2.0 ** 10


def _worker_amp() -> None:
    import torch.distributed as dist
    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(1)
    data = [(torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ)))
            for _ in range(3)]
    plain = _gpt()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    pipe = gpipe.distributed.Pipe(_gpt(), [2, 2, 2, 2], chunks=4)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    scaler = gpipe.distributed.grad_scaler(pipe, init_scale=INIT_SCALE)

    def scaled_loss(output, target):
        return scaler.scale(_loss(output, target))

    reference = dict(plain.named_parameters(remove_duplicate=False))
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        loss_fn=scaled_loss)
        inject = step == 1
        if inject and dist.get_rank() == 2:
            next(p for p in pipe.parameters() if p.grad is not None).grad.view(-1)[0] = \
                float("nan")
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        scaler.step(opt)
        scaler.update()
        moved = max((p - before[n]).abs().max().item() for n, p in pipe.named_parameters())
        if not inject:
            plain_opt.zero_grad()
            _loss(plain(x), y).backward()
            plain_opt.step()
        error = max((p - reference[n]).abs().max().item() for n, p in pipe.named_parameters())
        td._report(check=f"step {step}", injected=inject, moved=moved, error=error,
                   scale=scaler.get_scale())

    # autocast around train_step reaches the stages on every rank (the workers run under the
    # caller's thread-local state).
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    seen = []
    for layer in model:
        layer.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    pipe = gpipe.distributed.Pipe(model, [1, 1, 1, 1], chunks=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn=lambda out, t: torch.nn.functional.mse_loss(out.float(), t))
    td._report(check="autocast", dtypes=sorted(set(seen)), cells=len(seen),
               loss=None if loss is None else loss.item(),
               grad_dtypes=sorted({str(p.grad.dtype) for p in pipe.parameters()}))
    dist.destroy_process_group()


_runs: dict = {}


def _run() -> dict:
    """One launch serves both tests."""
    if "amp" not in _runs:
        _runs["amp"] = td._spawn("amp", 4, script=os.path.abspath(__file__))
    return _runs["amp"]


def test_one_ranks_nan_skips_the_step_on_every_rank():
    run = _run()
    for step in range(3):
        found = td._results(run, f"step {step}")
        for rank, r in found.items():
            # Scaled and unscaled by a power of two: the plain model's step, or none at all.
            assert r["error"] <= 1e-12, (step, rank, r)
            if r["injected"]:
                assert r["moved"] == 0.0, (step, rank, r)
            else:
                assert r["moved"] > 0.0, (step, rank, r)
        # Every rank's scale alike: halved after the skipped step.
        assert {r["scale"] for r in found.values()} == {INIT_SCALE if step < 1
                                                        else INIT_SCALE / 2}, found


def test_autocast_around_train_step_reaches_every_rank():
    run = _run()
    found = td._results(run, "autocast")
    for rank, r in found.items():
        assert r["dtypes"] == ["torch.bfloat16"] and r["cells"] >= 2, (rank, r)
        assert r["grad_dtypes"] == ["torch.float32"], (rank, r)
    assert found[3]["loss"] is not None and found[3]["loss"] == found[3]["loss"], found[3]


if __name__ == "__main__":
    {"amp": _worker_amp}[sys.argv[1]]()
