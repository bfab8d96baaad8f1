"""Pipeline x FSDP2: a gpipe.distributed.Pipe over a DeviceMesh's "pp" dimension whose layers
(or whose stages, ``fully_shard(pipe)``) are sharded with torch's fully_shard over the "dp"
dimension trains as the plain model on the whole batch, and each FSDP unit all-gathers and
reduce-scatters once per step, not once per micro-batch. The same for layers made FSDP2's
DDP-style units (torch.distributed._composable.replicate_with_fsdp.replicate): one all_reduce
per unit per step.

2 pipeline ranks x 2 replicas on 4 Gloo processes, test_distributed_ranks' GPT with and
without its tie across ranks (embedding on the first, lm_head on the last), float64, every
schedule, checkpoint 'never' and 'always', 2 SGD steps. The workers
count FSDP2's collectives by wrapping torch.distributed.all_gather_into_tensor and
reduce_scatter_tensor, which FSDP2 calls. Each test spawns this file as worker processes
(test_distributed's ``_spawn``).
"""
import os
import sys
from datetime import timedelta

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402
from test_distributed_clip import _untied  # noqa: E402
from test_distributed_ranks import SEQ, VOCAB, _gpt, _loss  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2))
CHECKPOINTS = ("never", "always")
STEPS = 2
CHUNKS = 4


def _count_collectives() -> dict:
    """Counts the all-gathers, reduce-scatters and all_reduces FSDP2 issues from now on."""
    import torch.distributed as dist

    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for name, key in (("all_gather_into_tensor", "all_gather"),
                      ("reduce_scatter_tensor", "reduce_scatter"), ("all_reduce", "all_reduce")):
        original = getattr(dist, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    return counts


def _worker(way: str) -> None:
    """``way``: "layer", "stage" or "replicate", "-tied" for the GPT with its tie (the
    embedding on the first rank, the head on the last)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    import gpipe.distributed

    per, _, tied = way.partition("-")
    model = _gpt if tied else _untied
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    counts = _count_collectives()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    replica = mesh["dp"].get_local_rank()
    torch.manual_seed(1)
    data = [(torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ)))
            for _ in range(STEPS)]
    for schedule, v in SCHEDULES:
        for checkpoint in CHECKPOINTS:
            plain = model()
            plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
            pipe = gpipe.distributed.Pipe(model(), [4 // v] * (2 * v), chunks=CHUNKS,
                                          schedule=schedule, virtual_stages=v,
                                          checkpoint=checkpoint, group=mesh["pp"].get_group())
            if per in ("layer", "replicate"):
                for layer in pipe.children():
                    (fully_shard if per == "layer" else replicate)(layer, mesh=mesh["dp"])
                units = len(list(pipe.children()))
            else:
                fully_shard(pipe, mesh=mesh["dp"])
                units = 1
            opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
            per_step = []
            for x, y in data:
                plain_opt.zero_grad()
                _loss(plain(x), y).backward()
                plain_opt.step()
                rows = slice(replica * 4, (replica + 1) * 4)
                before = dict(counts)
                opt.zero_grad()
                pipe.train_step(x[rows] if pipe.is_first else None,
                                y[rows] if pipe.is_last else None, loss_fn=_loss)
                per_step.append({k: counts[k] - before[k] for k in counts})
                opt.step()
            reference = dict(plain.named_parameters(remove_duplicate=False))
            error = max((p.full_tensor() - reference[n]).abs().max().item()
                        for n, p in pipe.named_parameters())
            x = data[0][0][replica * 4:(replica + 1) * 4]
            out = pipe.eval_step(x if pipe.is_first else None)
            eval_error = ((out - plain(x)).abs().max().item() if pipe.is_last else 0.0)
            # replicate's DTensors hold the whole tensor on every replica.
            sharded = (all(hasattr(p, "full_tensor") for p in pipe.parameters()) and
                       (per == "replicate" or
                        any(p.to_local().numel() < p.numel() for p in pipe.parameters())))
            td._report(check=f"{schedule}-{checkpoint}", error=error, eval_error=eval_error,
                       per_step=per_step, units=units, sharded_after=sharded)
    dist.destroy_process_group()


def _worker_layer() -> None:
    _worker("layer")


def _worker_stage() -> None:
    _worker("stage")


def _worker_replicate() -> None:
    _worker("replicate")


def _worker_layer_tied() -> None:
    _worker("layer-tied")


def _worker_stage_tied() -> None:
    _worker("stage-tied")


def _worker_replicate_tied() -> None:
    _worker("replicate-tied")


_runs: dict = {}


def _run(per: str) -> dict:
    """One launch per way of sharding serves all its checks."""
    if per not in _runs:
        _runs[per] = td._spawn(per, 4, script=os.path.abspath(__file__))
    return _runs[per]


@pytest.mark.parametrize("per", ["layer", "stage", "replicate", "layer-tied", "stage-tied",
                                 "replicate-tied"])
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_sharded_pipe_trains_as_the_plain_model(per, schedule, checkpoint):
    found = td._results(_run(per), f"{schedule}-{checkpoint}")
    for rank, r in found.items():
        assert r["error"] <= 1e-12, (rank, r)
        assert r["eval_error"] <= 1e-12, (rank, r)
        # Between steps, a rank keeps its shards only.
        assert r["sharded_after"], (rank, r)


@pytest.mark.parametrize("per", ["layer", "stage", "layer-tied", "stage-tied"])
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_each_unit_gathers_and_reduces_once_per_step(per, schedule):
    """Not once per micro-batch: with CHUNKS micro-batches FSDP2's own hooks would issue
    CHUNKS times as many."""
    for checkpoint in CHECKPOINTS:
        found = td._results(_run(per), f"{schedule}-{checkpoint}")
        for rank, r in found.items():
            for step in r["per_step"]:
                assert step == {"all_gather": r["units"], "reduce_scatter": r["units"],
                                "all_reduce": 0}, (rank, checkpoint, r)


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_each_replicated_unit_all_reduces_once_per_step(schedule):
    """FSDP2's replicate (DDP-style units: parameters whole on every replica) under the pipe:
    one all_reduce per unit per step and nothing gathered."""
    for checkpoint in CHECKPOINTS:
        found = td._results(_run("replicate"), f"{schedule}-{checkpoint}")
        for rank, r in found.items():
            for step in r["per_step"]:
                assert step == {"all_gather": 0, "reduce_scatter": 0,
                                "all_reduce": r["units"]}, (rank, checkpoint, r)


if __name__ == "__main__":
    {"layer": _worker_layer, "stage": _worker_stage, "replicate": _worker_replicate,
     "layer-tied": _worker_layer_tied, "stage-tied": _worker_stage_tied,
     "replicate-tied": _worker_replicate_tied}[sys.argv[1]]()
