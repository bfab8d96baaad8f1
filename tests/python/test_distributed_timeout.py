"""step_timeout: a rank stuck inside a step (a layer that does not return for a while) makes the
ranks waiting for it fail within the timeout, each naming what it waited for (stage,
micro-batch, schedule action) and the rank that owes it, instead of waiting for the process
group's timeout; every rank's step fails.

4 Gloo processes, schedule 1f1b, chunks 2; stage 2's layer sleeps 5 s in its first forward,
step_timeout is 1 s, the group's own timeout 60 s. Each test spawns this file as worker
processes (test_distributed's ``_spawn``).
"""
import os
import sys
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402

STUCK_S = 5.0
TIMEOUT_S = 1.0


class _Stuck(nn.Module):
    """A linear layer whose first forward takes STUCK_S seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            time.sleep(STUCK_S)
        return self.linear(x)


def _worker_timeout() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Stuck(), nn.Linear(4, 4))
    pipe = gpipe.distributed.Pipe(model, [1, 1, 1, 1], chunks=2, schedule="1f1b",
                                  step_timeout=TIMEOUT_S)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    started = time.monotonic()
    try:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        loss_fn=nn.functional.mse_loss)
        error = ""
    except RuntimeError as e:
        error = str(e)
    td._report(check="timeout", error=error, seconds=time.monotonic() - started,
               step_timeout=pipe.step_timeout)
    bad = []
    for value in (0, -1.0, "1s"):
        try:
            pipe.step_timeout = value
            bad.append("")
        except (TypeError, ValueError) as e:
            bad.append(f"{type(e).__name__}: {e}")
    pipe.step_timeout = timedelta(seconds=2)
    td._report(check="settings", bad=bad, as_timedelta=pipe.step_timeout)
    # The group's point-to-point state is undefined after a failed step: ranks exit here.
    os._exit(0)


_runs: dict = {}


def _run() -> dict:
    if "timeout" not in _runs:
        _runs["timeout"] = td._spawn("timeout", 4, script=os.path.abspath(__file__))
    return _runs["timeout"]


def test_the_ranks_waiting_for_a_stuck_one_fail_naming_their_wait():
    found = td._results(_run(), "timeout")
    for rank, r in found.items():
        assert r["error"], f"rank {rank}'s step did not fail: {r}"
        # Well within the group's 60 s: the stuck layer's 5 s, then a timeout or two.
        assert r["seconds"] < STUCK_S + 5 * TIMEOUT_S + 10, (rank, r)
        assert r["step_timeout"] == TIMEOUT_S
    # Stage 3 waited for its first input from the stuck rank 2, stage 1 for its first grad.
    three, one = found[3]["error"], found[1]["error"]
    assert ("rank 3 waited 1 s (the pipe's step_timeout) for stage 3's activations of "
            "micro-batch 0, for its forward 3F0, from rank 2" in three), three
    assert ("rank 1 waited 1 s (the pipe's step_timeout) for stage 1's grads of micro-batch "
            "0, for its backward 1B0, from rank 2" in one), one
    assert found[1]["seconds"] < STUCK_S and found[3]["seconds"] < STUCK_S, found


def test_step_timeout_is_checked():
    found = td._results(_run(), "settings")
    for rank, r in found.items():
        zero, negative, text = r["bad"]
        assert "ValueError" in zero and "positive" in zero and "None" in zero, r
        assert "ValueError" in negative, r
        assert "TypeError" in text and "timedelta" in text, r
        assert r["as_timedelta"] == 2.0, r


if __name__ == "__main__":
    {"timeout": _worker_timeout}[sys.argv[1]]()
