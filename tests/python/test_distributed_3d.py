"""The pipeline in a 3-D layout, 8 Gloo processes: PP x HSDP (FSDP2 sharding over one mesh
dimension, replicas over another) and PP x FSDP x TP (tensor parallel inside each stage, FSDP2
over the data-parallel dimension, as torchtitan composes them). Both train as the plain model
on the whole batch, and each FSDP unit gathers, reduce-scatters and all-reduces once per step.

PP 2 x 2 x 2, float64, 1f1b and interleaved_1f1b, checkpoint 'never' and 'always', 2 SGD steps,
test_distributed_tp's model (transformer MLP blocks: Colwise up, Rowwise down). One launch of
8 processes serves every check (test_distributed's ``_spawn``); the workers count FSDP2's
collectives as test_distributed_fsdp does.
"""
import os
import sys
from datetime import timedelta

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402
from test_distributed_fsdp import _count_collectives  # noqa: E402
from test_distributed_tp import WIDTH, _model  # noqa: E402

SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2))
CHECKPOINTS = ("never", "always")
LAYOUTS = ("hsdp", "fsdp_tp")
ROWS = 16


def _worker_3d() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    counts = _count_collectives()
    torch.manual_seed(1)
    data = [(torch.randn(ROWS, WIDTH, dtype=torch.double),
             torch.randn(ROWS, WIDTH, dtype=torch.double)) for _ in range(2)]
    for layout in LAYOUTS:
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "rep", "shard"))
            dp = mesh["rep", "shard"]
            replica, replicas = dp._flatten().get_local_rank(), 4
        else:
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
            dp = mesh["dp"]
            replica, replicas = dp.get_local_rank(), 2
        rows = slice(replica * ROWS // replicas, (replica + 1) * ROWS // replicas)
        for schedule, v in SCHEDULES:
            for checkpoint in CHECKPOINTS:
                plain = _model()
                plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
                pipe = gpipe.distributed.Pipe(_model(), [4 // (2 * v)] * (2 * v), chunks=4,
                                              schedule=schedule, virtual_stages=v,
                                              checkpoint=checkpoint, mesh=mesh)
                for layer in pipe.children():
                    if layout == "fsdp_tp":
                        parallelize_module(layer, mesh["tp"],
                                           {"up": ColwiseParallel(), "down": RowwiseParallel()})
                    fully_shard(layer, mesh=dp)
                opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
                per_step = []
                for x, y in data:
                    plain_opt.zero_grad()
                    nn.functional.mse_loss(plain(x), y).backward()
                    plain_opt.step()
                    before = dict(counts)
                    opt.zero_grad()
                    pipe.train_step(x[rows] if pipe.is_first else None,
                                    y[rows] if pipe.is_last else None,
                                    loss_fn=nn.functional.mse_loss)
                    per_step.append({k: counts[k] - before[k] for k in counts})
                    opt.step()
                reference = dict(plain.named_parameters())
                error = max((p.full_tensor() - reference[n]).abs().max().item()
                            for n, p in pipe.named_parameters())
                x = data[0][0][rows]
                out = pipe.eval_step(x if pipe.is_first else None)
                eval_error = (out - plain(x)).abs().max().item() if pipe.is_last else 0.0
                td._report(check=f"{layout}-{schedule}-{checkpoint}", error=error,
                           eval_error=eval_error, per_step=per_step,
                           units=len(list(pipe.children())),
                           sharded=all(hasattr(p, "full_tensor") for p in pipe.parameters()),
                           group_ranks=dist.get_process_group_ranks(pipe.group))
    dist.destroy_process_group()


_runs: dict = {}


def _run() -> dict:
    if "3d" not in _runs:
        _runs["3d"] = td._spawn("3d", 8, script=os.path.abspath(__file__))
    return _runs["3d"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_3d_layout_trains_as_the_plain_model(layout, schedule, checkpoint):
    found = td._results(_run(), f"{layout}-{schedule}-{checkpoint}")
    assert sorted(found) == list(range(8)), found
    for rank, r in found.items():
        assert r["error"] <= 1e-12, (rank, r)
        assert r["eval_error"] <= 1e-12, (rank, r)
        assert r["sharded"], (rank, r)
    # The pipeline runs over the mesh's first dimension: ranks 0 and 4, 1 and 5, ...
    assert found[0]["group_ranks"] == [0, 4] and found[3]["group_ranks"] == [3, 7]


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_each_hsdp_unit_gathers_reduces_and_all_reduces_once_per_step(schedule):
    """HSDP: an all-gather and a reduce-scatter over the shard dimension, an all_reduce over
    the replicas, once per unit per step (not per micro-batch)."""
    for checkpoint in CHECKPOINTS:
        found = td._results(_run(), f"hsdp-{schedule}-{checkpoint}")
        for rank, r in found.items():
            units = r["units"]
            for step in r["per_step"]:
                assert step == {"all_gather": units, "reduce_scatter": units,
                                "all_reduce": units}, (rank, checkpoint, r)


if __name__ == "__main__":
    {"3d": _worker_3d}[sys.argv[1]]()
