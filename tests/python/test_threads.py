"""CPU stages split the caller's intra-op threads between them; the caller's count stays."""
import threading
from typing import List

import pytest
import torch
from torch import nn

import gpipe
from gpipe import _C


class ThreadCount(nn.Module):
    """Identity that records torch.get_num_threads() of the thread running it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[int] = []

    def forward(self, x):
        self.seen.append(torch.get_num_threads())
        return x


def new_thread_count() -> int:
    seen: List[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_default_split_and_the_callers_count_stays():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        probes = [ThreadCount() for _ in range(3)]
        layers = []
        for probe in probes:
            layers += [nn.Linear(4, 4), probe]
        pipe = gpipe.Pipe(nn.Sequential(*layers), balance=[2, 2, 2], devices=["cpu"] * 3,
                          chunks=2)
        assert pipe._engine.intra_op_threads == [2, 1, 1]
        pipe(torch.randn(4, 4, requires_grad=True)).sum().backward()
        assert [sorted(set(p.seen)) for p in probes] == [[2], [1], [1]]
        assert torch.get_num_threads() == 4
        assert new_thread_count() == 4
    finally:
        torch.set_num_threads(before)


def test_engine_option_overrides_and_refuses_below_minus_one():
    parts = [[nn.Linear(2, 2)], [nn.Linear(2, 2)]]
    cpus = [torch.device("cpu")] * 2
    assert _C.Engine(parts, cpus, 1, "never", intra_op_threads=3).intra_op_threads == [3, 3]
    assert _C.Engine(parts, cpus, 1, "never", intra_op_threads=-1).intra_op_threads == [0, 0]
    with pytest.raises(ValueError, match="intra_op_threads is -2"):
        _C.Engine(parts, cpus, 1, "never", intra_op_threads=-2)
