"""Pipeline x tensor parallel: a gpipe.distributed.Pipe built with ``mesh=`` (a DeviceMesh with
"pp" and "tp" dimensions) whose stages' layers are parallelized with
torch.distributed.tensor.parallel (ColwiseParallel then RowwiseParallel, boundary activations
plain tensors) trains as the plain model.

PP 2 x TP 2 on 4 Gloo processes, float64, every schedule, checkpoint 'never' and 'always', 2 SGD
steps. A rank's cells run on one worker in the plan's order, so the TP collectives of the two
ranks of a "tp" group come in the same order. Each test spawns this file as worker processes
(test_distributed's ``_spawn``).
"""
import os
import sys
from datetime import timedelta

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2))
CHECKPOINTS = ("never", "always")
WIDTH = 8


class _MLP(nn.Module):
    """A transformer's MLP block: Colwise up, Rowwise down."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_MLP() for _ in range(4)]).double()


def _worker_tp() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(1)
    data = [(torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double))
            for _ in range(2)]
    for schedule, v in SCHEDULES:
        for checkpoint in CHECKPOINTS:
            plain = _model()
            plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
            pipe = gpipe.distributed.Pipe(_model(), [4 // (2 * v)] * (2 * v), chunks=4,
                                          schedule=schedule, virtual_stages=v,
                                          checkpoint=checkpoint, mesh=mesh)
            for layer in pipe.children():
                parallelize_module(layer, mesh["tp"],
                                   {"up": ColwiseParallel(), "down": RowwiseParallel()})
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for x, y in data:
                plain_opt.zero_grad()
                nn.functional.mse_loss(plain(x), y).backward()
                plain_opt.step()
                opt.zero_grad()
                pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                loss_fn=nn.functional.mse_loss)
                opt.step()
            reference = dict(plain.named_parameters())
            error = max((p.full_tensor() - reference[n]).abs().max().item()
                        for n, p in pipe.named_parameters())
            x = data[0][0]
            out = pipe.eval_step(x if pipe.is_first else None)
            eval_error = (out - plain(x)).abs().max().item() if pipe.is_last else 0.0
            td._report(check=f"{schedule}-{checkpoint}", error=error, eval_error=eval_error,
                       sharded=all(hasattr(p, "full_tensor") for p in pipe.parameters()),
                       group_ranks=dist.get_process_group_ranks(pipe.group))

    errors = []
    for kwargs in ({"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "tp"))},
                   {"mesh": mesh, "group": mesh["pp"].get_group()}, {"mesh": "pp"}):
        try:
            gpipe.distributed.Pipe(_model(), [2, 2], **kwargs)
            errors.append("")
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    td._report(check="mesh errors", errors=errors)
    dist.destroy_process_group()


_runs: dict = {}


def _run() -> dict:
    if "tp" not in _runs:
        _runs["tp"] = td._spawn("tp", 4, script=os.path.abspath(__file__))
    return _runs["tp"]


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_tensor_parallel_stages_train_as_the_plain_model(schedule, checkpoint):
    found = td._results(_run(), f"{schedule}-{checkpoint}")
    for rank, r in found.items():
        assert r["error"] <= 1e-12, (rank, r)
        assert r["eval_error"] <= 1e-12, (rank, r)
        assert r["sharded"], (rank, r)
    # The pipeline runs over the mesh's "pp" dimension: ranks 0 and 2, 1 and 3.
    assert found[0]["group_ranks"] == [0, 2] and found[1]["group_ranks"] == [1, 3]


def test_a_mesh_without_pp_or_with_a_group_is_refused():
    found = td._results(_run(), "mesh errors")
    for rank, r in found.items():
        no_pp, both, not_a_mesh = r["errors"]
        assert "ValueError" in no_pp and "['a', 'tp']" in no_pp and "'pp'" in no_pp, r
        assert "ValueError" in both and "not both" in both, r
        assert "TypeError" in not_a_mesh and "DeviceMesh" in not_a_mesh, r


if __name__ == "__main__":
    {"tp": _worker_tp}[sys.argv[1]]()
