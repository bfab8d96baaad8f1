"""What the ranks of a gpipe.distributed.Pipe must share: tied weights across ranks (a small GPT
whose lm_head reuses the token embedding) train exactly as the plain model over several optimizer
steps on 2 and 4 Gloo processes, every schedule; ranks whose settings or layers differ all refuse
at construction, naming each rank's value; batch_dim as in-process.

Each test spawns this file as worker processes (test_distributed's ``_spawn``); the workers print
one RESULT line per check.
"""
import copy
import os
import sys
from datetime import timedelta

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402

VOCAB = 11
WIDTH = 8
SEQ = 5
STEPS = 3


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)

    def forward(self, ids):
        return self.tok(ids) + self.pos


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.mix(self.norm(x)))


class _Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = embedding.weight  # tied, as GPT-2's lm_head

    def forward(self, x):
        return self.out(self.norm(x))


def _gpt() -> nn.Sequential:
    """8 layers: embedding, 6 blocks, a head tied to the embedding (first and last rank)."""
    torch.manual_seed(0)
    embed = _Embed()
    return nn.Sequential(embed, *[_Block() for _ in range(6)], _Head(embed.tok)).double()


def _loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _worker_gpt() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    rank = dist.get_rank()
    torch.manual_seed(1)
    xs = [torch.randint(0, VOCAB, (8, SEQ)) for _ in range(STEPS)]
    ys = [torch.randint(0, VOCAB, (8, SEQ)) for _ in range(STEPS)]
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
                        ("zb_v", 2)):
        for checkpoint in ("always", "except_last", "never"):
            name = f"{schedule}-{checkpoint}"
            plain = _gpt()
            opt = torch.optim.SGD(plain.parameters(), lr=0.5)
            expected = []
            for x, y in zip(xs, ys):
                opt.zero_grad()
                loss = _loss(plain(x), y)
                loss.backward()
                opt.step()
                expected.append(loss.item())

            model = _gpt()
            if rank == world - 1:
                # A replica that starts off: the lowest owner's values win.
                with torch.no_grad():
                    model[7].out.weight.add_(1.0)
            stages = world * v
            pipe = gpipe.distributed.Pipe(model, [8 // stages] * stages, chunks=4,
                                          schedule=schedule, virtual_stages=v,
                                          checkpoint=checkpoint)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
            losses = []
            for x, y in zip(xs, ys):
                opt.zero_grad()
                loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                       loss_fn=_loss)
                opt.step()
                losses.append(None if loss is None else loss.item())
            reference = dict(plain.named_parameters(remove_duplicate=False))
            error = max((p - reference[n]).abs().max().item()
                        for n, p in pipe.named_parameters())
            tied = {n: p.detach().clone() for n, p in pipe.named_parameters()
                    if n in ("0.tok.weight", "7.out.weight")}
            # Every replica equal, bit for bit: gather them on rank 0.
            mine = next(iter(tied.values())) if tied else torch.zeros(VOCAB, WIDTH,
                                                                      dtype=torch.double)
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            last = 0 if schedule == "zb_v" else (stages - 1) % world  # zb_v: a V
            owners = [r for r, _ in enumerate(gathered) if r in (0, last)]
            td._report(check=name, param_error=error,
                       loss_error=max((abs(a - b) for a, b in zip(losses, expected)
                                       if a is not None), default=0.0),
                       replicas_equal=all(torch.equal(gathered[owners[0]], gathered[r])
                                          for r in owners),
                       ties=pipe.tied_parameters)
    dist.destroy_process_group()


def _worker_disagree() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    cases = {
        "balance": dict(balance=[3, 1, 2, 2] if rank == 0 else [2, 2, 2, 2]),
        "schedule": dict(balance=[2, 2, 2, 2], schedule="gpipe" if rank == 2 else "1f1b"),
        "chunks": dict(balance=[2, 2, 2, 2], chunks=3 if rank == 1 else 4),
        "checkpoint": dict(balance=[2, 2, 2, 2], checkpoint="never" if rank == 3 else "always"),
        "batch_dim": dict(balance=[2, 2, 2, 2], batch_dim=1 if rank == 0 else 0),
    }
    for case, kwargs in cases.items():
        kwargs.setdefault("chunks", 4)
        try:
            gpipe.distributed.Pipe(td._mlp(8), **kwargs)
            td._report(check=case, error=None)
        except ValueError as e:
            td._report(check=case, error=str(e))
    # A layer of another shape on rank 3.
    model = td._mlp(8)
    if rank == 3:
        model[2] = nn.Linear(6, 6, bias=False).double()
    try:
        gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4)
        td._report(check="layer", error=None)
    except ValueError as e:
        td._report(check="layer", error=str(e))
    # Ranks that agree go on training over the same group.
    model = td._mlp(8)
    pipe = gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4)
    x = torch.randn(8, 6, dtype=torch.double)
    loss = pipe.train_step(x if pipe.is_first else None, x if pipe.is_last else None,
                           loss_fn=nn.functional.mse_loss)
    td._report(check="after", loss=None if loss is None else loss.item())
    dist.destroy_process_group()


class _AddPositions(nn.Module):
    """(x [B, T, W], positions [T]) -> x + positions' embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(SEQ, 6)

    def forward(self, inputs):
        x, positions = inputs
        return x + self.pos(positions)


def _worker_batch_dim() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(_AddPositions(), *td._mlp(7)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, SEQ, 6, dtype=torch.double)
    positions = torch.arange(SEQ)
    y = torch.randn(8, SEQ, 6, dtype=torch.double)
    pipe = gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4, batch_dim=[0, None])
    loss = pipe.train_step((x, positions) if pipe.is_first else None,
                           y if pipe.is_last else None, loss_fn=nn.functional.mse_loss)
    expected = nn.functional.mse_loss(reference((x, positions)), y)
    expected.backward()
    td._report(check="batch_dim", grad_error=td._max_grad_error(pipe, reference),
               loss_error=0.0 if loss is None else abs(loss.item() - expected.item()))
    dist.destroy_process_group()


# ---- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4])
def gpt(request):
    return request.param, td._spawn("gpt", world=request.param, script=__file__)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_tied_weights_across_ranks_train_as_the_plain_model(gpt, schedule, checkpoint):
    world, run = gpt
    results = td._results(run, f"{schedule}-{checkpoint}")
    for rank, r in results.items():
        assert r["param_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)
        assert r["replicas_equal"], (rank, r)
        if schedule == "zb_v":
            # The V puts the first and the last stage on rank 0: one rank holds the tie,
            # nothing to exchange.
            assert r["ties"] == [], (rank, r)
            continue
        stages = world * (2 if schedule == "interleaved_1f1b" else 1)
        assert r["ties"] == [[["0.tok.weight", "7.out.weight"], [0, (stages - 1) % world]]]


@pytest.fixture(scope="module")
def disagree():
    return td._spawn("disagree", script=__file__)


@pytest.mark.parametrize("case,line", [
    ("balance", "balance: rank 0 has [3, 1, 2, 2]; ranks 1, 2 and 3 have [2, 2, 2, 2]"),
    ("schedule", "schedule: ranks 0, 1 and 3 have 1f1b; rank 2 has gpipe"),
    ("chunks", "chunks: ranks 0, 2 and 3 have 4; rank 1 has 3"),
    ("checkpoint", "checkpoint: ranks 0, 1 and 2 have always; rank 3 has never"),
    ("batch_dim", "batch_dim: rank 0 has [1]; ranks 1, 2 and 3 have [0]"),
    ("layer", "layer 2: ranks 0, 1 and 2 have weight [6, 6] float64, bias [6] float64; "
              "rank 3 has weight [6, 6] float64"),
])
def test_ranks_that_disagree_all_refuse_naming_each_value(disagree, case, line):
    results = td._results(disagree, case)
    for rank, r in results.items():
        assert r["error"] is not None, (rank, disagree["logs"])
        assert "every rank must build the same model" in r["error"], r["error"]
        assert line in r["error"], r["error"]


def test_ranks_that_agree_train_after_a_refusal(disagree):
    results = td._results(disagree, "after")
    assert results[3]["loss"] is not None and results[0]["loss"] is None


def test_batch_dim_none_shares_a_value_across_ranks():
    run = td._spawn("batch_dim", script=__file__)
    for rank, r in td._results(run, "batch_dim").items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)


def test_chunks_may_be_an_integral_float():
    import gpipe
    pipe = gpipe.Pipe(td._mlp(4), [2, 2], chunks=4.0, devices=["cpu", "cpu"])
    assert pipe.chunks == 4 and isinstance(pipe.chunks, int)
    with pytest.raises(TypeError, match="chunks must be an int, got 2.7"):
        gpipe.Pipe(td._mlp(4), [2, 2], chunks=2.7, devices=["cpu", "cpu"])


if __name__ == "__main__":
    {"gpt": _worker_gpt, "disagree": _worker_disagree,
     "batch_dim": _worker_batch_dim}[sys.argv[1]]()
