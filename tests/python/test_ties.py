"""A weight tied across devices in one process (issue 22): the parameter lives on the device of
its first layer, later layers on other devices use a copy per forward whose grad autograd brings
home, and the pipe trains as the plain model does. This machine has one device (the CPU), so the
copies are forced here as they would be made between two GPUs (``param.to(device, copy=True)``
on a layer the pipe is told sits elsewhere); test_cuda.py runs the same model over two GPUs.
"""
import copy
import os
import sys

import pytest
import torch
from torch import nn

import gpipe
from gpipe.pipe import _tie_across_devices

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import MODES  # noqa: E402
from test_distributed_ranks import SEQ, VOCAB, _gpt, _loss  # noqa: E402

STEPS = 3
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


def forced_tie(pipe: gpipe.Pipe) -> None:
    """Hands the last layer (the head tied to the embedding) copies, as if it ran on another
    device than the embedding."""
    devices = [torch.device("cpu")] * (len(pipe._layers) - 1) + [torch.device("cpu", 1)]
    hooks = _tie_across_devices(pipe, pipe._layers, devices)
    assert [[(type(o).__name__, n) for o, n, _ in h.uses] for h in hooks] == [[("Linear",
                                                                                 "weight")]]
    watch_copies(pipe)


def watch_copies(pipe: gpipe.Pipe) -> None:
    """Checks, at each forward of the head's Linear, that it got a copy, not the parameter."""
    def check(module: nn.Module, args: object) -> None:
        assert not isinstance(module.weight, nn.Parameter) and module.weight.grad_fn is not None

    pipe[7].out.register_forward_pre_hook(check)


def batches():
    torch.manual_seed(1)
    return [(torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ)))
            for _ in range(STEPS)]


def plain_run(data):
    plain = _gpt()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = _loss(plain(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return plain, losses


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
def test_train_step_with_a_weight_tied_across_devices_is_the_plain_models(schedule, virtual,
                                                                         checkpoint):
    data = batches()
    plain, expected = plain_run(data)
    stages = 4 * virtual
    pipe = gpipe.Pipe(_gpt(), balance=[8 // stages] * stages, chunks=4, checkpoint=checkpoint,
                      schedule=schedule, virtual_stages=virtual, devices=["cpu"] * 4)
    forced_tie(pipe)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = pipe.train_step(x, y, loss_fn=_loss)
        opt.step()
        assert abs(loss.item() - expected[step]) <= 1e-10, (step, loss.item(), expected[step])
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters(remove_duplicate=False):
        assert (p - reference[name]).abs().max().item() <= 1e-10, name
    # Still one parameter, the one the optimizer holds, with the plain model's state_dict keys.
    assert pipe[7].out.weight is pipe[0].tok.weight
    assert isinstance(pipe[7].out.weight, nn.Parameter)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert len(list(pipe.parameters())) == len(list(plain.parameters()))


@pytest.mark.parametrize("checkpoint", MODES)
def test_drop_in_forward_backward_with_a_weight_tied_across_devices(checkpoint):
    data = batches()
    plain, _ = plain_run(data)
    pipe = gpipe.Pipe(_gpt(), balance=[2, 2, 2, 2], chunks=3, checkpoint=checkpoint)
    forced_tie(pipe)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for x, y in data:
        opt.zero_grad()
        _loss(pipe(x), y).backward()
        opt.step()
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters(remove_duplicate=False):
        assert (p - reference[name]).abs().max().item() <= 1e-10, name


def test_a_copied_pipe_keeps_its_own_tie():
    """The hooks are objects holding the layer's own parameter: deepcopy gives the copy hooks
    on its own parameter (a closure would keep feeding it the original's)."""
    pipe = gpipe.Pipe(_gpt(), balance=[2, 2, 2, 2], chunks=2)
    forced_tie(pipe)
    twin = copy.deepcopy(pipe)
    with torch.no_grad():
        pipe[0].tok.weight.zero_()  # the original's parameter only
    x, y = batches()[0]
    plain = _gpt()
    assert torch.allclose(twin(x), plain(x), atol=1e-12, rtol=0)
    twin.zero_grad()
    _loss(twin(x), y).backward()
    assert twin[0].tok.weight.grad is not None and pipe[0].tok.weight.grad is None


def test_a_buffer_shared_across_devices_is_refused_before_anything_moves():
    """'meta' is a second device on any machine: the check runs before any layer moves."""
    first, last = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    last.running_mean = first.running_mean
    seq = nn.Sequential(first, nn.Tanh(), last)  # (.double() would untie a buffer)
    with pytest.raises(ValueError) as e:
        gpipe.Pipe(seq, balance=[2, 1], devices=["cpu", "meta"])
    for part in ("buffer '2.running_mean'", "'0.running_mean' of layer 0", "cpu", "meta",
                 "put those layers on one device, or give each its own buffer"):
        assert part in str(e.value), (part, str(e.value))
    assert seq[0].running_mean.device.type == "cpu"  # nothing moved


def test_a_module_shared_across_devices_is_refused():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Sequential(nn.Tanh()))
    seq[2].append(seq[0])  # the same Linear inside a later layer
    with pytest.raises(ValueError) as e:
        gpipe.Pipe(seq, balance=[2, 1], devices=["cpu", "meta"])
    for part in ("module '2.1' of layer 2 (on meta)", "'0' of layer 0 (on cpu)",
                 "share the parameter (b.weight = a.weight)"):
        assert part in str(e.value), (part, str(e.value))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_weight_tied_between_the_cpu_and_a_gpu(schedule):
    """The real thing: the embedding on the CPU, the head tied to it on cuda:0."""
    data = batches()
    plain, expected = plain_run(data)
    pipe = gpipe.Pipe(_gpt(), balance=[2, 2, 2, 2], chunks=4, schedule=schedule,
                      devices=["cpu", "cuda:0"])
    watch_copies(pipe)
    assert pipe[0].tok.weight.device.type == "cpu" and pipe[7].out.weight is pipe[0].tok.weight
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = pipe.train_step(x, y.cuda(), loss_fn=_loss)
        opt.step()
        assert abs(loss.item() - expected[step]) <= 1e-10, (step, loss.item(), expected[step])
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters(remove_duplicate=False):
        assert (p.cpu() - reference[name]).abs().max().item() <= 1e-10, name
