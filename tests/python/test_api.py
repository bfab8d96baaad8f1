"""The Pipe's public surface: torchgpipe attributes, layer access, state_dict, casting, lifetime."""
import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import gpipe
from conftest import assert_close, compare_with_plain


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(),
                         nn.Linear(4, 2)).double()


def test_gpipe_is_pipe():
    assert gpipe.GPipe is gpipe.Pipe
    assert issubclass(gpipe.Pipe, nn.Module)


def test_public_names():
    for name in ("Pipe", "GPipe", "is_checkpointing", "is_recomputing"):
        assert name in gpipe.__all__ and hasattr(gpipe, name)
    assert isinstance(gpipe.__version__, str)


def test_attributes():
    pipe = gpipe.Pipe(model(), balance=[2, 3], chunks=4, checkpoint="never")
    assert pipe.balance == [2, 3]
    assert all(type(b) is int for b in pipe.balance)
    assert pipe.devices == [torch.device("cpu"), torch.device("cpu")]
    assert all(isinstance(d, torch.device) for d in pipe.devices)
    assert pipe.chunks == 4 and type(pipe.chunks) is int
    assert pipe.checkpoint == "never"


def test_defaults():
    pipe = gpipe.Pipe(model(), balance=[5])
    assert pipe.chunks == 1
    assert pipe.checkpoint == "except_last"
    assert pipe.devices == [torch.device("cpu")]


def test_balance_given_as_tuple_of_ints():
    pipe = gpipe.Pipe(model(), balance=(1, 4))
    assert pipe.balance == [1, 4]


def test_extra_devices_are_dropped():
    pipe = gpipe.Pipe(model(), balance=[2, 3], devices=["cpu", "cpu", "cpu", "cpu"])
    assert pipe.devices == [torch.device("cpu")] * 2
    pipe = gpipe.Pipe(model(), balance=[5], devices=[torch.device("cpu"), "cpu"])
    assert pipe.devices == [torch.device("cpu")]


def test_len_iter_getitem():
    seq = model()
    layers = list(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 2, 1])
    assert len(pipe) == 5
    assert list(pipe) == layers
    assert [type(m) for m in pipe] == [nn.Linear, nn.ReLU, nn.Linear, nn.Tanh, nn.Linear]
    for i in range(5):
        assert pipe[i] is layers[i]
        assert pipe[i - 5] is layers[i]
    assert pipe[-1] is layers[-1]
    with pytest.raises(IndexError):
        pipe[5]
    with pytest.raises(IndexError):
        pipe[-6]


def test_pipe_adopts_the_layers():
    """The Pipe runs the Sequential's own layer objects: changing one changes the Pipe."""
    seq = model()
    pipe = gpipe.Pipe(seq, balance=[2, 3])
    x = torch.randn(4, 3, dtype=torch.float64)
    before = pipe(x).detach()
    with torch.no_grad():
        seq[4].bias.add_(1.0)
    assert_close(pipe(x).detach(), before + 1.0, what="output after editing the layer")


def test_named_parameters_and_state_dict_keys():
    seq = model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 3])
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(pipe.state_dict()) == list(ref.state_dict())
    assert "0.weight" in pipe.state_dict() and "4.bias" in pipe.state_dict()
    assert len(list(pipe.parameters())) == len(list(ref.parameters())) == 6


def test_state_dict_keys_with_buffers():
    seq = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[1, 2])
    assert list(pipe.state_dict()) == list(ref.state_dict())
    assert "1.running_mean" in pipe.state_dict()


def test_load_state_dict_from_plain_into_pipe():
    pipe = gpipe.Pipe(model(), balance=[2, 3], chunks=2)
    other = model()  # different random weights
    pipe.load_state_dict(other.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    assert_close(pipe(x).detach(), other(x).detach(), what="output after load_state_dict")


def test_load_state_dict_from_pipe_into_plain():
    pipe = gpipe.Pipe(model(), balance=[2, 3], chunks=2)
    plain = model()
    plain.load_state_dict(pipe.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    assert_close(plain(x).detach(), pipe(x).detach(), what="output after load_state_dict")
    for (n, p), (m, q) in zip(plain.named_parameters(), pipe.named_parameters()):
        assert n == m and torch.equal(p, q)


def test_load_state_dict_is_strict():
    pipe = gpipe.Pipe(model(), balance=[2, 3])
    with pytest.raises(RuntimeError):
        pipe.load_state_dict({"0.weight": torch.zeros(4, 3, dtype=torch.float64)})


@pytest.mark.parametrize("move", [
    lambda p: p.to("cuda"),
    lambda p: p.to(torch.device("cuda", 0)),
    lambda p: p.to(device="meta"),
    lambda p: p.to("cuda:0", torch.float64),
    lambda p: p.to(torch.zeros(1, device="meta")),
    lambda p: p.cuda(),
    lambda p: p.cuda(0),
], ids=["to-str", "to-device", "to-device-kwarg", "to-str-dtype", "to-tensor", "cuda", "cuda-0"])
def test_moving_elsewhere_is_refused(move):
    pipe = gpipe.Pipe(model(), balance=[2, 3], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="devices="):
        move(pipe)
    assert all(p.device.type == "cpu" for p in pipe.parameters())


@pytest.mark.parametrize("move", [
    lambda p: p.to("cpu"),
    lambda p: p.to(torch.device("cpu")),
    lambda p: p.to(device="cpu"),
    lambda p: p.to("cpu", torch.float64),
    lambda p: p.to(torch.zeros(1, dtype=torch.float64)),
    lambda p: p.cpu(),
], ids=["to-str", "to-device", "to-device-kwarg", "to-str-dtype", "to-tensor", "cpu"])
def test_moving_where_the_stages_are_changes_nothing(move):
    pipe = gpipe.Pipe(model(), balance=[2, 3], devices=["cpu", "cpu"])
    assert move(pipe) is pipe
    assert all(p.device.type == "cpu" and p.dtype == torch.float64 for p in pipe.parameters())
    pipe(torch.randn(2, 3, dtype=torch.float64)).sum().backward()


def test_double_casts_and_stays_transparent():
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))  # float32
    ref = copy.deepcopy(seq).double()
    pipe = gpipe.Pipe(seq, balance=[2, 1], chunks=2)
    assert pipe.double() is pipe
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, want = pipe(x), ref(x_ref)
    assert out.dtype == torch.float64
    assert_close(out, want, what="output after .double()")
    out.sum().backward()
    want.sum().backward()
    assert_close(x.grad, x_ref.grad, what="input grad after .double()")


def test_half_casts():
    pipe = gpipe.Pipe(model(), balance=[2, 3])
    assert pipe.half() is pipe
    assert all(p.dtype == torch.float16 for p in pipe.parameters())
    assert all(p.dtype == torch.float16 for layer in pipe for p in layer.parameters())


def test_to_dtype_casts():
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = gpipe.Pipe(seq, balance=[1, 2])
    assert pipe.to(torch.float64) is pipe
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    assert pipe.to(dtype=torch.float32) is pipe
    assert all(p.dtype == torch.float32 for p in pipe.parameters())
    assert pipe(torch.randn(2, 3)).dtype == torch.float32


def test_train_and_eval_reach_the_layers():
    pipe = gpipe.Pipe(model(), balance=[2, 3])
    pipe.eval()
    assert not pipe.training and not any(layer.training for layer in pipe)
    pipe.train()
    assert pipe.training and all(layer.training for layer in pipe)


def test_repr_names_the_options():
    text = repr(gpipe.Pipe(model(), balance=[2, 3], chunks=4, checkpoint="always"))
    assert "[2, 3]" in text and "chunks=4" in text and "always" in text


@pytest.mark.parametrize("batch", [1, 3, 5, 8, 13])
def test_odd_batch_sizes(batch):
    x = torch.randn(batch, 3, dtype=torch.float64, requires_grad=True)
    compare_with_plain(model(), x, balance=[1, 2, 2], chunks=4)


def test_pipe_is_reusable_for_many_steps():
    seq = model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 3], chunks=3)
    for step in range(20):
        x = torch.randn(6 + step % 4, 3, dtype=torch.float64)
        assert_close(pipe(x).detach(), ref(x).detach(), what=f"output at step {step}")


_LIFETIME_SCRIPT = textwrap.dedent("""
    import torch, gpipe
    from torch import nn
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1], chunks=2)
    out = pipe(torch.randn(4, 2))
    del pipe          # the output (and its graph) outlives the Pipe
    out.sum().backward() if {backward} else None
    del out
    print("survived")
""")


@pytest.mark.parametrize("backward", [False, True], ids=["dropped", "backward"])
def test_output_outlives_pipe(backward):
    """Freeing a Pipe before its output's graph neither crashes nor breaks backward.
    Run in a subprocess: the failure mode is an abort that would take pytest down."""
    proc = subprocess.run([sys.executable, "-c", _LIFETIME_SCRIPT.format(backward=backward)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "survived" in proc.stdout, (
        f"exit code {proc.returncode}; stderr:\n{proc.stderr[-2000:]}")
