"""gpipe.distributed.Pipe's trace: a Send and a Receive span for each hand-off with another rank.

The test spawns this file as 2 worker processes (``python test_distributed_trace.py
SCENARIO`` with torch.distributed's environment); each traces a step and prints its events
(times moved onto the machine's steady clock with the pipe's ``trace_origin_ns``) as RESULT
lines, and the test matches the ranks' ends of every hand-off.
"""
import json
import os
import sys
import time
from collections import Counter

import torch
from torch import nn

WORLD = 2
STAGES = 8  # virtual_stages 4: stage s on rank s % 2
CHUNKS = 4

import test_distributed as td  # noqa: E402
from gpipe.skip import Namespace  # noqa: E402


def _with_skips() -> nn.Sequential:
    """8 one-layer stages, skips 0 -> 7 (rank 0 to rank 1) and 3 -> 5 (rank 1 to itself)."""
    torch.manual_seed(0)
    a, b = Namespace(), Namespace()
    return nn.Sequential(td._Save().isolate(a), nn.Linear(6, 6), nn.Tanh(),
                         td._Save().isolate(b), nn.Linear(6, 6), td._Add().isolate(b), nn.Tanh(),
                         td._Add().isolate(a)).double()


def _spawn(scenario: str) -> dict:
    """Runs ``scenario`` on WORLD processes (test_distributed's spawner); returns {rank:
    [result, ...]}."""
    run = td._spawn(scenario, WORLD, script=os.path.abspath(__file__))
    assert run["codes"] == [0] * WORLD, run["logs"]
    return run["results"]


def _worker_trace() -> None:
    import torch.distributed as dist

    import gpipe
    import gpipe.distributed

    dist.init_process_group("gloo")
    try:
        model = _with_skips()
        pipe = gpipe.distributed.Pipe(model, [1] * STAGES, chunks=CHUNKS,
                                      schedule="interleaved_1f1b", virtual_stages=STAGES // WORLD,
                                      checkpoint="never")
        x = torch.randn(8, 6, dtype=torch.float64)
        y = torch.randn(8, 6, dtype=torch.float64)
        step = lambda: pipe.train_step(x if pipe.is_first else None,  # noqa: E731
                                       target=y if pipe.is_last else None,
                                       loss_fn=nn.functional.mse_loss)
        step()  # untraced: no events
        pipe.tracing = True
        before = time.monotonic_ns()
        step()
        after = time.monotonic_ns()
        origin = pipe.trace_origin_ns
        for e in pipe.trace.events:
            print("RESULT " + json.dumps(dict(
                step=e.step, stage=e.stage, microbatch=e.microbatch, phase=e.phase, peer=e.peer,
                start=origin / 1e3 + e.start_us, end=origin / 1e3 + e.end_us,
                before=before / 1e3, after=after / 1e3)), flush=True)
    finally:
        dist.destroy_process_group()


def test_distributed_trace_has_a_send_and_a_receive_per_remote_handoff():
    results = _spawn("trace")
    events = [e for rank in range(WORLD) for e in results[rank]]
    # Every event lies within its rank's traced step on the machine's steady
    # clock: trace_origin_ns places the trace there.
    for e in events:
        assert e["before"] <= e["start"] <= e["end"] <= e["after"], e
        assert e["step"] == 0
    for rank in range(WORLD):
        assert {e["stage"] % WORLD for e in results[rank]} == {rank}
    # What crosses ranks: activations and grads between consecutive stages,
    # the skip 0 -> 7 and its grad; the skip 3 -> 5 stays on rank 1.
    pairs = [(s, s + 1) for s in range(STAGES - 1)] + [(s + 1, s) for s in range(STAGES - 1)]
    pairs += [(0, 7), (7, 0)]
    expected = Counter((a, b, i) for a, b in pairs for i in range(CHUNKS))
    sends = Counter((e["stage"], e["peer"], e["microbatch"]) for e in events
                    if e["phase"] == "send")
    receives = Counter((e["peer"], e["stage"], e["microbatch"]) for e in events
                       if e["phase"] == "receive")
    assert sends == expected
    assert receives == expected
    assert all(e["peer"] == -1 for e in events if e["phase"] not in ("send", "receive"))
    # One clock: a hand-off arrives after it was sent.
    first_send = {}
    for e in events:
        if e["phase"] == "send":
            key = (e["stage"], e["peer"], e["microbatch"])
            first_send[key] = min(first_send.get(key, e["start"]), e["start"])
    for e in events:
        if e["phase"] == "receive":
            assert e["end"] >= first_send[(e["peer"], e["stage"], e["microbatch"])], e


def test_in_process_trace_has_no_handoffs():
    import gpipe

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    pipe = gpipe.Pipe(model, balance=[1, 1, 1], chunks=2, trace=True, schedule="1f1b")
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.train_step(x, target=torch.zeros(4, 4, dtype=torch.float64),
                    loss_fn=nn.functional.mse_loss)
    phases = {e.phase for e in pipe.trace.events}
    assert "forward" in phases
    assert not phases & {"send", "receive"}
    assert all(e.peer == -1 for e in pipe.trace.events)


if __name__ == "__main__":
    {"trace": _worker_trace}[sys.argv[1]]()
