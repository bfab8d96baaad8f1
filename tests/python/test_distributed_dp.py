"""Pipeline x data parallel: 2 pipelines of 2 Gloo ranks, grads averaged in the step (float64, 1e-10).

Ranks 0-1 and 2-3 are two pipelines; ranks 0-2 and 1-3 replicate a stage
each. Every replica trains on half of a batch; its grads must equal one
replica's (the plain Sequential's, and a single-process gpipe.Pipe's) on the
whole batch. As in test_distributed.py, this file is also the worker: one
spawn of 4 processes serves every check of a scenario.
"""
import copy
import os
import sys
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402

WORLD = 4
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))


def _spawn(scenario: str) -> dict:
    """td._spawn, running this file's workers."""
    return td._spawn(scenario, WORLD, script=os.path.abspath(__file__))


def _groups():
    """This rank's pipeline group and data-parallel group (fresh ones: a failed step leaves its
    groups unusable). Every rank creates every group, in the same order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return pipes[rank // 2], replicas[rank % 2]


def _model(layers: int) -> nn.Sequential:
    """td._mlp with the first bias frozen: it must keep no grad on every replica."""
    model = td._mlp(layers)
    model[0].bias.requires_grad_(False)
    return model


def _grad_error(pipe, reference) -> float:
    """Worst difference of this rank's grads from `reference`'s (a module with the same
    parameter names); a grad missing on exactly one side is an infinite error."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in pipe.named_parameters():
        mine, theirs = p.grad, ref[name].grad
        if mine is None or theirs is None:
            if (mine is None) != (theirs is None):
                return float("inf")
            continue
        worst = max(worst, (mine - theirs).abs().max().item())
    return worst


def _worker_dp() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(1)
    xs = [torch.randn(16, 6, dtype=torch.double) for _ in range(2)]
    ys = [torch.randn(16, 6, dtype=torch.double) for _ in range(2)]
    half = slice(0, 8) if rank < 2 else slice(8, 16)
    cases = [(s, v, 25) for s, v in SCHEDULES]
    # A cap below one weight's bytes (36 doubles): a bucket per parameter.
    cases += [("1f1b", 1, 100 / 2**20), ("interleaved_1f1b", 2, 100 / 2**20)]
    for schedule, v, cap in cases:
        pp, dp = _groups()
        model = _model(4 * v)
        reference = copy.deepcopy(model)
        single = gpipe.Pipe(copy.deepcopy(model), [2] * (2 * v), chunks=4, schedule=schedule,
                            virtual_stages=v, devices=["cpu"] * 2)
        pipe = gpipe.distributed.Pipe(model, [2] * (2 * v), chunks=4, schedule=schedule,
                                      virtual_stages=v, group=pp, dp_group=dp,
                                      bucket_cap_mb=cap)
        worst = 0.0
        launches = []
        # Two steps without zeroing: the second averages grads accumulated on the first.
        for x, y in zip(xs, ys):
            pipe.train_step(x[half] if pipe.is_first else None,
                            target=y[half] if pipe.is_last else None,
                            loss_fn=nn.functional.mse_loss)
            launches.append(pipe._engine.grad_reduce_launches())
            nn.functional.mse_loss(reference(x), y).backward()
            single.train_step(x, y, nn.functional.mse_loss)
            worst = max(worst, _grad_error(pipe, reference), _grad_error(pipe, single))
        frozen = [p.grad is None for n, p in pipe.named_parameters() if n == "0.bias"]
        td._report(check=f"{schedule}-{cap}", grad_error=worst, stages=pipe.stages,
                   launches=launches, frozen_none=frozen)
    dist.destroy_process_group()


class _RaisesInBackward(torch.autograd.Function):
    """Identity whose backward raises on rank `rank` at its `calls`-th call."""

    count = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _RaisesInBackward.count += 1
        if _RaisesInBackward.count == 4:
            td._report(check="raised", at=time.time())
            raise ValueError("stage 0 refuses its last backward")
        return grad


class _LastBackwardRaises(nn.Module):
    def forward(self, x):
        return _RaisesInBackward.apply(x)


def _worker_fail() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    x = torch.randn(8, 6, dtype=torch.double)

    def attempt(name, pipe, loss_fn):
        try:
            pipe.train_step(x if pipe.is_first else None, target=x if pipe.is_last else None,
                            loss_fn=loss_fn)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        at = time.time()
        try:
            pipe.train_step(x if pipe.is_first else None, target=x if pipe.is_last else None,
                            loss_fn=nn.functional.mse_loss)
            after = None
        except Exception as e:
            after = f"{type(e).__name__}: {e}"
        td._report(check=name, error=error, at=at, after=after)

    # Rank 3's loss_fn raises on its first micro-batch: before any grad is final.
    def loss_fn(out, target):
        if rank == 3:
            td._report(check="raised", at=time.time())
            raise ValueError("loss_fn refuses")
        return nn.functional.mse_loss(out, target)

    pp, dp = _groups()
    pipe = gpipe.distributed.Pipe(_model(4), [2, 2], chunks=4, schedule="1f1b", group=pp,
                                  dp_group=dp)
    attempt("loss", pipe, loss_fn)

    # Rank 2's stage 0 raises in its last backward, after its stage 2 has started its
    # buckets (interleaved): it completes them with zeros, then reports.
    pp, dp = _groups()
    model = _model(8)
    if rank == 2:
        model[1] = nn.Sequential(_LastBackwardRaises(), nn.Tanh())
    pipe = gpipe.distributed.Pipe(model, [2] * 4, chunks=4, schedule="interleaved_1f1b",
                                  virtual_stages=2, group=pp, dp_group=dp, checkpoint="never")
    attempt("late", pipe, nn.functional.mse_loss)
    td._report(check="late-launches", launches=pipe._engine.grad_reduce_launches())
    dist.destroy_process_group()


# ---- the tests -----------------------------------------------------------------------------


def _results(run, check, ranks=range(WORLD)):
    return td._results({"results": {r: run["results"][r] for r in ranks}, "logs": run["logs"]},
                       check)


@pytest.fixture(scope="module")
def dp_run():
    return _spawn("dp")


def test_pp_x_dp_equals_one_replica_on_the_whole_batch(dp_run):
    run = dp_run
    assert run["codes"] == [0] * WORLD, run["logs"]
    for schedule, v in SCHEDULES:
        for rank, r in _results(run, f"{schedule}-25").items():
            assert r["grad_error"] <= 1e-10, (schedule, rank, r)
            # The frozen bias (stage 0's) has no grad on either replica of stage 0.
            assert r["frozen_none"] == ([True] if 0 in r["stages"] else []), (schedule, rank, r)
            for launches in r["launches"]:
                # Every stage of the rank started its buckets once, in the step.
                assert sorted(stage for stage, _, _ in launches) == sorted(r["stages"]), r
                if schedule == "interleaved_1f1b":
                    # The later stage finishes first; its all_reduce runs while this rank's
                    # list still holds the earlier stage's last backwards.
                    (late, left, _), (early, _, _) = launches
                    assert late == max(r["stages"]) and early == min(r["stages"]), r
                    assert left >= 1, (rank, launches)


def test_small_buckets(dp_run):
    run = dp_run
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        for rank, r in _results(run, f"{schedule}-{100 / 2**20}").items():
            assert r["grad_error"] <= 1e-10, (schedule, rank, r)
            for launches in r["launches"]:
                # A weight (288 bytes) per bucket and the biases (48) on their own; stage 0's
                # bias is frozen.
                for stage, _, buckets in launches:
                    assert buckets == (1 if stage == 0 else 2), (schedule, rank, launches)


def test_failing_replica_fails_every_rank():
    run = _spawn("fail")
    assert run["codes"] == [0] * WORLD, run["logs"]
    # "late": rank 2's last backward fails after rank 3 (stages 1 and 3) is done with the
    # step, so the pipeline tells it nothing (as without data parallelism); ranks 1 and 3
    # replicate stages 1 and 3, whose grads were averaged. Ranks 0 and 2 (stages 0 and 2) fail.
    for case, culprit, what, ranks in (("loss", 3, "loss_fn refuses", range(WORLD)),
                                       ("late", 2, "stage 0 refuses its last backward", (0, 2))):
        raised = [x for x in run["results"][culprit] if x["check"] == "raised"]
        assert raised, run["logs"]
        started = raised[0]["at"]
        for rank, r in _results(run, case, ranks).items():
            assert r["error"] is not None, (case, rank, run["logs"])
            assert r["at"] - started <= td.FAILURE_DEADLINE, (case, rank, r)
            if rank == culprit:
                assert r["error"].startswith("ValueError: " + what), (case, r)
            elif rank // 2 == culprit // 2:
                assert f"rank {culprit % 2} failed" in r["error"], (case, rank, r)
            else:
                assert "data-parallel replica at rank 1 of dp_group" in r["error"], (case, rank, r)
            # Every rank refuses the next step instead of waiting for the others.
            assert r["after"] is not None and "a previous step" in r["after"], (case, rank, r)
    # Rank 2 had started stage 2's buckets when stage 0 failed.
    late = _results(run, "late-launches", ranks=[2])[2]
    assert late["launches"] and late["launches"][0][0] == 2, late


if __name__ == "__main__":
    {"dp": _worker_dp, "fail": _worker_fail}[sys.argv[1]]()
