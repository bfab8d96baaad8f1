"""Failures: bad arguments fail at construction; a layer's exception comes back as itself, named."""
import copy
import time
from typing import Any, Tuple

import pytest
import torch
from torch import Tensor, nn

import gpipe
from conftest import (Counter, MyError, RaiseInBackward, RaiseOnMicrobatch, call_with_timeout,
                      check_recovers, compare_with_plain, notes, raises_within_timeout)


def model(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(n)]).double()


# -- construction -------------------------------------------------------------

@pytest.mark.parametrize("module", [nn.Linear(2, 2), [nn.Linear(2, 2)],
                                    nn.ModuleList([nn.Linear(2, 2)])],
                         ids=["Linear", "list", "ModuleList"])
def test_module_must_be_sequential(module):
    with pytest.raises(TypeError):
        gpipe.Pipe(module, balance=[1])


@pytest.mark.parametrize("balance", [[1, 1], [2, 3], [5], [4, 0], [5, -1], [0, 4]])
def test_bad_balance(balance):
    with pytest.raises(ValueError, match="gpipe.balance") as excinfo:
        gpipe.Pipe(model(), balance=balance)
    assert str(balance) in str(excinfo.value) or str(sum(balance)) in str(excinfo.value)


@pytest.mark.parametrize("chunks", [0, -1])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match=str(chunks)):
        gpipe.Pipe(model(), balance=[4], chunks=chunks)


@pytest.mark.parametrize("mode", ["sometimes", "", "Always", "none"])
def test_unknown_checkpoint_mode(mode):
    with pytest.raises(ValueError, match="checkpoint"):
        gpipe.Pipe(model(), balance=[4], checkpoint=mode)


def test_fewer_devices_than_stages():
    with pytest.raises(IndexError):
        gpipe.Pipe(model(), balance=[1, 1, 2], devices=["cpu", "cpu"])
    with pytest.raises(IndexError):
        gpipe.Pipe(model(), balance=[2, 2], devices=[])


def test_shared_layer_is_refused():
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError):
        gpipe.Pipe(nn.Sequential(shared, nn.ReLU(), shared).double(), balance=[2, 1])


# -- inputs and outputs -------------------------------------------------------

@pytest.mark.parametrize("bad", [
    [torch.zeros(2, 3)],
    3,
    None,
    (torch.zeros(2, 3), 1),
    (torch.zeros(2, 3), [torch.zeros(2, 3)]),
    (),
], ids=["list", "int", "None", "tuple-with-int", "tuple-with-list", "empty-tuple"])
def test_non_tensor_input(bad):
    pipe = gpipe.Pipe(model(), balance=[2, 2], chunks=2)
    with pytest.raises(TypeError):
        pipe(bad)


def test_extra_positional_input():
    pipe = gpipe.Pipe(model(), balance=[2, 2], chunks=2)
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(TypeError):
        pipe(x, x)


class Returns(nn.Module):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: Tensor) -> Any:
        return self.value(x)


@pytest.mark.parametrize("where", ["last", "middle"])
@pytest.mark.parametrize("make", [lambda x: {"out": x}, lambda x: 1, lambda x: [x],
                                  lambda x: (x, None)],
                         ids=["dict", "int", "list", "tuple-with-None"])
def test_non_tensor_output(make, where):
    layers = [nn.Linear(3, 3), Returns(make), nn.Linear(3, 3)]
    if where == "last":
        layers = layers[:2]
    pipe = gpipe.Pipe(nn.Sequential(*layers).double(), balance=[1] * len(layers), chunks=2)
    x = torch.randn(4, 3, dtype=torch.float64)
    error = raises_within_timeout(lambda: pipe(x))
    assert isinstance(error, TypeError), repr(error)


# -- a layer's exception ------------------------------------------------------

class Raise(nn.Module):
    """Identity until armed; then raises ``error`` (in forward, or only in recompute)."""

    def __init__(self, error: BaseException, recompute_only: bool = False) -> None:
        super().__init__()
        self.error = error
        self.recompute_only = recompute_only
        self.armed = True
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.armed and (not self.recompute_only or gpipe.is_recomputing()):
            raise self.error
        return x


def three_stages(middle: nn.Module) -> Tuple[nn.Sequential, Counter, Counter]:
    """Stage 0: Linear, Counter; stage 1: Linear, ``middle``; stage 2: Counter, Linear."""
    first, last = Counter(), Counter()
    seq = nn.Sequential(nn.Linear(3, 3), first, nn.Linear(3, 3), middle, last,
                        nn.Linear(3, 3)).double()
    return seq, first, last


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("error_type", [MyError, ValueError, KeyError, RuntimeError])
def test_forward_error_is_the_layers_own(error_type, checkpoint):
    err = error_type("boom in the middle")
    seq, first, last = three_stages(Raise(err))
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)

    raised = raises_within_timeout(lambda: pipe(x))
    assert raised is err
    text = notes(raised)
    assert "stage 1" in text and "micro-batch 0" in text and "forward" in text, (
        f"stage and micro-batch not named; notes: {text!r}")
    # Stage 1 failed on micro-batch 0: it starts nothing after, and stage 2
    # (which only sees what stage 1 finished) sees nothing.
    assert pipe[3].calls == 1
    assert last.forwards == []
    assert 1 <= len(first.forwards) <= 4
    check_recovers(pipe, ref)


def test_forward_error_on_a_later_microbatch():
    err = MyError("boom on micro-batch 2")
    middle = RaiseOnMicrobatch(err, 2)
    seq, _, last = three_stages(middle)
    pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=4, checkpoint="never")
    raised = raises_within_timeout(lambda: pipe(torch.randn(8, 3, dtype=torch.float64)))
    assert raised is err
    assert "stage 1" in notes(raised) and "micro-batch 2" in notes(raised), notes(raised)
    assert middle.calls == 3          # micro-batch 3 never starts on stage 1
    assert len(last.forwards) <= 2    # stage 2 sees at most what stage 1 finished


class SlowStart(nn.Module):
    """Identity that notes each micro-batch it starts, then naps ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.started = seconds, []

    def forward(self, x: Tensor) -> Tensor:
        self.started.append(len(self.started))
        time.sleep(self.seconds)
        return x


@pytest.mark.parametrize("call", ["forward", "train_step"])
def test_no_cell_starts_after_a_later_stage_failed(call):
    """Issue 22: a slow stage 2 must not start micro-batch 2 once stage 3 failed on its
    first, although the input is already in its mailbox. Stage 3's first cell waits for
    stage 2's cells to let go of the CPU generator (its first cell of a step may set its
    stream): it then goes before stage 2's next cell, and the failure is known before
    that cell could start."""
    for attempt in range(4):
        slow = SlowStart(0.15)
        layers = [nn.Linear(3, 3), nn.Linear(3, 3), slow, RaiseOnMicrobatch(MyError("boom"), 0)]
        pipe = gpipe.Pipe(nn.Sequential(*layers).double(), balance=[1, 1, 1, 1], chunks=5)
        x = torch.randn(10, 3, dtype=torch.float64)
        if call == "forward":
            run = lambda: pipe(x)  # noqa: E731
        else:
            run = lambda: pipe.train_step(x, torch.zeros(10, 3, dtype=torch.float64),  # noqa: E731
                                          torch.nn.functional.mse_loss)
        raised = raises_within_timeout(run)
        assert isinstance(raised, MyError) and "stage 3" in notes(raised), notes(raised)
        assert slow.started in ([0], [0, 1]), (attempt, slow.started)


def test_forward_error_in_first_and_last_stage():
    for stage in (0, 2):
        err = MyError(f"boom in stage {stage}")
        layers = [nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)]
        layers.insert(stage + 1, Raise(err))
        pipe = gpipe.Pipe(nn.Sequential(*layers).double(), balance=[1, 1, 2] if stage == 2
                          else [2, 1, 1], chunks=3)
        raised = raises_within_timeout(lambda: pipe(torch.randn(6, 3, dtype=torch.float64)))
        assert raised is err
        assert f"stage {stage}" in notes(raised) and "micro-batch 0" in notes(raised)


def test_forward_error_under_no_grad():
    err = MyError("boom without grad")
    seq, _, last = three_stages(Raise(err))
    pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=4)

    def run() -> Tensor:
        with torch.no_grad():
            return pipe(torch.randn(8, 3, dtype=torch.float64))

    assert raises_within_timeout(run) is err
    assert last.forwards == []


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_backward_error_is_the_layers_own(checkpoint):
    err = MyError("boom in backward")
    middle = RaiseInBackward(err)
    seq, first, last = three_stages(middle)
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    out = call_with_timeout(lambda: pipe(x))["result"]

    raised = raises_within_timeout(lambda: out.sum().backward())
    assert raised is err
    text = notes(raised)
    # The GPipe backward runs micro-batches last to first: stage 1 fails on 3.
    assert "stage 1" in text and "micro-batch 3" in text and "backward" in text, (
        f"stage and micro-batch not named; notes: {text!r}")
    assert middle.backwards == 1   # stage 1 starts no other backward cell
    assert first.backwards == 0    # stage 0 only sees what stage 1 finished
    assert last.backwards <= 4
    del out  # before the Pipe goes: see test_api.py::test_output_outlives_pipe
    check_recovers(pipe, ref)


def test_recompute_error_is_the_layers_own():
    err = MyError("boom in recompute")
    middle = Raise(err, recompute_only=True)
    seq, first, last = three_stages(middle)
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=4, checkpoint="always")
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    out = call_with_timeout(lambda: pipe(x))["result"]  # the first forward passes
    assert middle.calls == 4 and len(last.forwards) == 4

    raised = raises_within_timeout(lambda: out.sum().backward())
    assert raised is err
    text = notes(raised)
    assert "stage 1" in text and "micro-batch 3" in text and "recompute" in text, (
        f"stage, micro-batch and phase not named; notes: {text!r}")
    assert middle.calls == 5          # one recompute, then nothing more on stage 1
    assert first.backwards == 0
    assert [c for c in first.forwards if c[1]] == []   # stage 0 never recomputed
    del out  # before the Pipe goes: see test_api.py::test_output_outlives_pipe
    check_recovers(pipe, ref)


def test_non_python_error_names_the_cell():
    """A torch error inside a layer (shape mismatch) is raised, naming stage and micro-batch."""
    seq = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(4, 3)).double()
    pipe = gpipe.Pipe(seq, balance=[1, 1, 1], chunks=2)
    raised = raises_within_timeout(lambda: pipe(torch.randn(4, 3, dtype=torch.float64)))
    assert isinstance(raised, RuntimeError)
    assert "stage 2" in str(raised) + notes(raised)
    assert "micro-batch 0" in str(raised) + notes(raised)


def test_error_then_many_calls():
    """Repeated failures leave no stuck worker: every call returns, the last succeeds."""
    err = MyError("again")
    seq, _, _ = three_stages(Raise(err))
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=3)
    for _ in range(10):
        assert raises_within_timeout(lambda: pipe(torch.randn(6, 3, dtype=torch.float64))) is err
    check_recovers(pipe, ref)


def test_keyboard_interrupt_passes_through():
    err = KeyboardInterrupt()
    pipe = gpipe.Pipe(three_stages(Raise(err))[0], balance=[2, 2, 2], chunks=2)
    assert raises_within_timeout(lambda: pipe(torch.randn(4, 3, dtype=torch.float64))) is err


def test_transparent_without_error():
    """The failure tests' models are transparent when nothing raises (the baseline)."""
    middle = Raise(MyError("unused"))
    middle.armed = False
    seq, _, _ = three_stages(middle)
    compare_with_plain(seq, torch.randn(8, 3, dtype=torch.float64, requires_grad=True),
                       balance=[2, 2, 2], chunks=4)


def test_destruction_never_blocks():
    """Pipes die promptly: idle, after a success, and right after a failure."""
    def make_and_drop() -> None:
        for k in range(20):
            middle = Raise(MyError("dropped"))
            middle.armed = k % 3 == 2
            seq, _, _ = three_stages(middle)
            pipe = gpipe.Pipe(seq, balance=[2, 2, 2], chunks=3)
            if k % 3 == 1:
                pipe(torch.randn(6, 3, dtype=torch.float64)).sum().backward()
            elif k % 3 == 2:
                with pytest.raises(MyError):
                    pipe(torch.randn(6, 3, dtype=torch.float64))
            del pipe

    assert "error" not in call_with_timeout(make_and_drop)
