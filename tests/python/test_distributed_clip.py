"""gpipe.distributed.clip_grad_norm_: the whole model's grad norm across the pipeline's ranks,
as the plain model's torch.nn.utils.clip_grad_norm_ gives it, and every rank clipped alike.

A GPT whose lm_head reuses the token embedding (test_distributed_ranks' model: the tie spans the
first and the last rank) on 4 Gloo ranks, and the same model on 2 pipeline ranks x 2 replicas
(dp_group). Each rank builds the plain model too and compares with its clipped grads (float64).
Each test spawns this file as worker processes (test_distributed's ``_spawn``).
"""
import os
import sys
from datetime import timedelta

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402
from test_distributed_ranks import SEQ, VOCAB, _gpt, _loss  # noqa: E402

NORMS = (2.0, 1.0, float("inf"))
# (max_norm, which clips): 0.05 is below every norm here, 1e9 above.
LIMITS = (0.05, 1e9)


def _spawn(scenario: str, world: int = 4) -> dict:
    return td._spawn(scenario, world, script=os.path.abspath(__file__))


def _compare(pipe, plain, batch, pipe_batch, reference_rows):
    """For each norm and limit: the plain model's clip on the whole batch against the pipe's on
    its share; returns [(case, norm error, worst grad error)]."""
    import gpipe.distributed

    x, y = batch
    px, py = pipe_batch
    out = []
    for norm_type in NORMS:
        for max_norm in LIMITS:
            plain.zero_grad()
            _loss(plain(x[:reference_rows]), y[:reference_rows]).backward()
            expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
            pipe.zero_grad()
            pipe.train_step(px if pipe.is_first else None, py if pipe.is_last else None,
                            loss_fn=_loss)
            total = gpipe.distributed.clip_grad_norm_(pipe, max_norm, norm_type)
            reference = dict(plain.named_parameters(remove_duplicate=False))
            worst = max((p.grad - reference[n].grad).abs().max().item()
                        for n, p in pipe.named_parameters())
            out.append((f"norm {norm_type}, max_norm {max_norm}",
                        abs(total.item() - expected.item()) / expected.item(), worst,
                        total.item(), expected.item()))
    return out


def _worker_clip() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ))
    plain = _gpt()
    pipe = gpipe.distributed.Pipe(_gpt(), [8 // world] * world, chunks=4)
    for case, norm_error, grad_error, total, expected in _compare(pipe, plain, (x, y), (x, y), 8):
        td._report(check=case, norm_error=norm_error, grad_error=grad_error, total=total,
                   expected=expected)

    # A non-finite grad on one rank: every rank refuses alike (error_if_nonfinite), or, without
    # it, every rank returns the same non-finite norm.
    pipe.zero_grad()
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, loss_fn=_loss)
    if dist.get_rank() == 1:
        next(p for p in pipe.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    try:
        gpipe.distributed.clip_grad_norm_(pipe, 1.0, error_if_nonfinite=True)
        error = ""
    except RuntimeError as e:
        error = str(e)
    td._report(check="nonfinite", error=error,
               total=gpipe.distributed.clip_grad_norm_(pipe, 1.0).item())
    try:
        gpipe.distributed.clip_grad_norm_(plain, 1.0)
        error = ""
    except TypeError as e:
        error = str(e)
    td._report(check="not a pipe", error=error)
    dist.destroy_process_group()


def _worker_clip_dp() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(1)
    x, y = torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ))
    replica = rank // 2
    half = (x[replica * 4:(replica + 1) * 4], y[replica * 4:(replica + 1) * 4])
    plain = _gpt()
    pipe = gpipe.distributed.Pipe(_gpt(), [4, 4], chunks=2, group=pipes[replica],
                                  dp_group=replicas[rank % 2])
    for case, norm_error, grad_error, total, expected in _compare(pipe, plain, (x, y), half, 8):
        td._report(check=case, norm_error=norm_error, grad_error=grad_error, total=total,
                   expected=expected)
    dist.destroy_process_group()


_runs: dict = {}


def _run(scenario: str) -> dict:
    """One launch per scenario serves all its checks."""
    if scenario not in _runs:
        _runs[scenario] = _spawn(scenario)
    return _runs[scenario]


def _untied():
    """The GPT with its lm_head's own weight."""
    model = _gpt()
    model[7].out.weight = torch.nn.Parameter(model[7].out.weight.detach().clone())
    return model


def _worker_clip_fsdp() -> None:
    """2 pipeline ranks x 2 replicas, each layer sharded over the replicas with FSDP2's
    fully_shard: grads (and so the norm's pieces) are DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(1)
    x, y = torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ))
    replica = mesh["dp"].get_local_rank()
    px, py = x[replica * 4:(replica + 1) * 4], y[replica * 4:(replica + 1) * 4]
    plain = _untied()
    pipe = gpipe.distributed.Pipe(_untied(), [4, 4], chunks=2, group=mesh["pp"].get_group())
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    for norm_type in NORMS:
        for max_norm in LIMITS:
            plain.zero_grad()
            _loss(plain(x), y).backward()
            expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
            pipe.zero_grad()
            pipe.train_step(px if pipe.is_first else None, py if pipe.is_last else None,
                            loss_fn=_loss)
            total = gpipe.distributed.clip_grad_norm_(pipe, max_norm, norm_type)
            reference = dict(plain.named_parameters(remove_duplicate=False))
            worst = max((p.grad.full_tensor() - reference[n].grad).abs().max().item()
                        for n, p in pipe.named_parameters())
            td._report(check=f"norm {norm_type}, max_norm {max_norm}",
                       norm_error=abs(total.item() - expected.item()) / expected.item(),
                       grad_error=worst, total=total.item(), expected=expected.item())

    # With the tie: fully_shard swaps the tied Parameter on ranks 0 and 1 of each replica;
    # the tie's grads are summed on the units' unsharded copies, counted once in the norm.
    plain = _gpt()
    plain.zero_grad()
    _loss(plain(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    tied = gpipe.distributed.Pipe(_gpt(), [4, 4], chunks=2, group=mesh["pp"].get_group())
    for layer in tied.children():
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    tied.train_step(px if tied.is_first else None, py if tied.is_last else None, loss_fn=_loss)
    total = gpipe.distributed.clip_grad_norm_(tied, 1.0)
    reference = dict(plain.named_parameters(remove_duplicate=False))
    worst = max((p.grad.full_tensor() - reference[n].grad).abs().max().item()
                for n, p in tied.named_parameters())
    td._report(check="tie and fully_shard", norm_error=abs(total.item() - expected.item()),
               grad_error=worst)

    # A tied Parameter replaced by anything else (here an assignment on the last rank) is
    # refused on every rank, not trained wrong.
    replaced = gpipe.distributed.Pipe(_gpt(), [4, 4], chunks=2, group=mesh["pp"].get_group())
    if replaced.is_last:
        head = replaced.get_submodule("7").out
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    try:
        replaced.train_step(px if replaced.is_first else None,
                            py if replaced.is_last else None, loss_fn=_loss)
        error = ""
    except (RuntimeError, ValueError) as e:
        error = str(e)
    td._report(check="tie replaced", error=error, last=replaced.is_last)
    dist.destroy_process_group()


def test_a_tie_sharded_by_fully_shard_clips_as_the_plain_model():
    found = td._results(_run("clip_fsdp"), "tie and fully_shard")
    for rank, r in found.items():
        assert r["norm_error"] <= 1e-12, (rank, r)
        assert r["grad_error"] <= 1e-12, (rank, r)


def test_a_tie_replaced_otherwise_is_refused_on_every_rank():
    found = td._results(_run("clip_fsdp"), "tie replaced")
    for rank, r in found.items():
        if r["last"]:
            assert "tied across ranks, was replaced" in r["error"], (rank, r)
        else:
            assert "was replaced" in r["error"] and "rank 1" in r["error"], (rank, r)


@pytest.mark.parametrize("scenario", ["clip", "clip_dp", "clip_fsdp"])
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("max_norm", LIMITS)
def test_the_norm_and_the_clipped_grads_are_the_plain_models(scenario, norm_type, max_norm):
    found = td._results(_run(scenario), f"norm {norm_type}, max_norm {max_norm}")
    for rank, r in found.items():
        assert r["norm_error"] <= 1e-12, (rank, r)
        assert r["grad_error"] <= 1e-12, (rank, r)
    # Every rank returns the same number.
    assert len({r["total"] for r in found.values()}) == 1, found


def test_a_nonfinite_norm_is_refused_on_every_rank_alike():
    run = _run("clip")
    found = td._results(run, "nonfinite")
    for rank, r in found.items():
        assert "non-finite" in r["error"] and "error_if_nonfinite=False" in r["error"], (rank, r)
        assert r["total"] == float("inf"), (rank, r)
    found = td._results(run, "not a pipe")
    for rank, r in found.items():
        assert "gpipe.distributed.Pipe" in r["error"] and "torch.nn.utils" in r["error"], r


if __name__ == "__main__":
    {"clip": _worker_clip, "clip_dp": _worker_clip_dp,
     "clip_fsdp": _worker_clip_fsdp}[sys.argv[1]]()
