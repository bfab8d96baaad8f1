"""The edges a new user meets first: argument forms, slicing, copying and pickling, help(),
hooks on recompute, deferred batch norm leaving the caller's model alone, torch.compile."""
import copy
import enum
import os
import pickle
import pydoc
import threading
import warnings
from collections import OrderedDict
from typing import Any, List

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import gpipe
from gpipe.batchnorm import DeferredBatchNorm
from conftest import TOL, assert_close, assert_same_grads, compare_with_plain, mlp


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(),
                         nn.Linear(4, 2)).double()


def x_of(rows: int = 8, cols: int = 3) -> Tensor:
    return torch.randn(rows, cols, dtype=torch.float64)


# -- devices ------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_one_device_means_every_stage(device):
    pipe, _ = compare_with_plain(model(), x_of().requires_grad_(), balance=[2, 1, 2],
                                 devices=device, chunks=4)
    assert pipe.devices == [torch.device("cpu")] * 3


def test_one_device_without_balance_is_one_stage():
    pipe = gpipe.Pipe(model(), devices="cpu")
    assert pipe.balance == [5] and pipe.devices == [torch.device("cpu")]


@pytest.mark.parametrize("devices", [0, 2, True, np.int64(1), 1.0])
def test_int_devices_is_refused_with_the_fix(devices):
    with pytest.raises(TypeError, match="devices=") as excinfo:
        gpipe.Pipe(model(), balance=[2, 3], devices=devices)
    assert repr(devices) in str(excinfo.value)


def test_a_bad_device_string_is_named():
    with pytest.raises(ValueError, match="'gpu0'") as excinfo:
        gpipe.Pipe(model(), balance=[2, 3], devices=["cpu", "gpu0"])
    assert "devices[1]" in str(excinfo.value)


@pytest.mark.parametrize("devices", [[0, 1], ["cuda:0", "cuda:1"], ["cpu", "cuda"]],
                         ids=["ints", "strs", "mixed"])
def test_cuda_devices_without_cuda(monkeypatch, devices):
    """Refused at construction, naming the device and the CPU fix, before any layer moves
    (torch's own error would be 'Found no NVIDIA driver' from deep inside .to())."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seq = model()
    with pytest.raises(ValueError, match=r"devices=\['cpu', 'cpu'\]") as excinfo:
        gpipe.Pipe(seq, balance=[2, 3], devices=devices)
    assert "cuda" in str(excinfo.value) and "is_available" in str(excinfo.value)
    assert all(p.device.type == "cpu" for p in seq.parameters())


def test_cuda_index_past_the_last_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="cuda:1") as excinfo:
        gpipe.Pipe(model(), balance=[2, 3], devices=[0, 1])
    text = str(excinfo.value)
    assert "1 CUDA device" in text and "devices=" in text


def test_fewer_devices_than_stages_names_the_values_and_the_fix():
    with pytest.raises(IndexError) as excinfo:
        gpipe.Pipe(model(), balance=[1, 1, 3], devices=["cpu", "cpu"])
    text = str(excinfo.value)
    assert "2 devices" in text and "3 stages" in text, text
    assert "devices=" in text and "'cpu'" in text, f"no fix given: {text}"


# -- balance and chunks --------------------------------------------------------

@pytest.mark.parametrize("balance", [[2.5, 2.5], [2.0, 3.0], [True, 4], ["2", "3"],
                                     [np.float64(2), 3], [torch.tensor(2.0), 3]],
                         ids=["fractions", "whole-floats", "bool", "strs", "numpy-float",
                              "float-tensor"])
def test_non_integer_balance_is_refused(balance):
    seq = model()
    with pytest.raises(TypeError, match="balance") as excinfo:
        gpipe.Pipe(seq, balance=balance)
    text = str(excinfo.value)
    assert repr(balance[0]) in text, f"the bad entry is not named: {text}"
    assert "[2, 3]" in text or "e.g." in text, f"no fix given: {text}"


@pytest.mark.parametrize("balance", [[np.int64(2), np.int32(3)], [torch.tensor(2), 3],
                                     np.array([2, 3]), torch.tensor([2, 3])],
                         ids=["numpy-ints", "int-tensor", "numpy-array", "tensor"])
def test_integral_balance_entries_are_accepted(balance):
    pipe = gpipe.Pipe(model(), balance=balance)
    assert pipe.balance == [2, 3] and all(type(b) is int for b in pipe.balance)


@pytest.mark.parametrize("balance", [2, "23", None], ids=["int", "str", "None-no-devices"])
def test_balance_not_a_list(monkeypatch, balance):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises((TypeError, ValueError), match="balance") as excinfo:
        gpipe.Pipe(model(), balance=balance)
    text = str(excinfo.value)
    assert "gpipe.balance" in text, f"no pointer to computing one: {text}"
    if balance == 2:
        assert isinstance(excinfo.value, TypeError)
        assert "balance_by_params(2, " in text and "[1, 1]" in text, text


@pytest.mark.parametrize("chunks", [2.7, "4", True, None, torch.tensor(2.5)],
                         ids=["fraction", "str", "bool", "None", "float-tensor"])
def test_non_integer_chunks_is_refused(chunks):
    with pytest.raises(TypeError, match="chunks") as excinfo:
        gpipe.Pipe(model(), balance=[2, 3], chunks=chunks)
    assert repr(chunks) in str(excinfo.value)


@pytest.mark.parametrize("chunks", [np.int64(4), torch.tensor(4), 4.0],
                         ids=["numpy", "tensor", "whole-float (as torchgpipe)"])
def test_integral_chunks_are_accepted(chunks):
    pipe = gpipe.Pipe(model(), balance=[2, 3], chunks=chunks)
    assert pipe.chunks == 4 and type(pipe.chunks) is int


# -- checkpoint -----------------------------------------------------------------

class Mode(enum.Enum):
    NEVER = "never"

    def __str__(self) -> str:
        return self.value


class StrMode(str, enum.Enum):
    ALWAYS = "always"

    def __str__(self) -> str:
        return self.value


@pytest.mark.parametrize("mode,want", [(Mode.NEVER, "never"), (StrMode.ALWAYS, "always")],
                         ids=["enum", "str-enum"])
def test_checkpoint_accepts_anything_that_prints_as_a_mode(mode, want):
    pipe, _ = compare_with_plain(model(), x_of().requires_grad_(), balance=[2, 3], chunks=4,
                                 checkpoint=mode)
    assert pipe.checkpoint == want and type(pipe.checkpoint) is str


@pytest.mark.parametrize("mode", ["sometimes", None, 1])
def test_bad_checkpoint_lists_the_modes(mode):
    with pytest.raises(ValueError) as excinfo:
        gpipe.Pipe(model(), balance=[2, 3], checkpoint=mode)
    text = str(excinfo.value)
    assert "'always'" in text and "'except_last'" in text and "'never'" in text
    assert repr(str(mode)) in text


# -- slicing -------------------------------------------------------------------

def test_slice_returns_the_layers_as_a_sequential():
    seq = model()
    layers = list(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 3])
    part = pipe[1:3]
    assert type(part) is nn.Sequential
    assert list(part) == layers[1:3] and all(a is b for a, b in zip(part, layers[1:3]))
    assert list(part._modules) == ["1", "2"]   # the Sequential's own names, as nn.Sequential
    assert [m for m in pipe[::-2]] == layers[::-2]
    assert len(pipe[7:9]) == 0
    x = torch.randn(4, 4, dtype=torch.float64)
    assert torch.equal(pipe[2:](x), nn.Sequential(*layers[2:])(x))


def test_index_of_another_type_is_refused():
    pipe = gpipe.Pipe(model(), balance=[2, 3])
    assert pipe[np.int64(1)] is pipe[1]
    with pytest.raises(TypeError, match="'1'"):
        pipe["1"]


# -- copying and pickling -------------------------------------------------------

def run_step(pipe: nn.Module, x: Tensor) -> Tensor:
    out = pipe(x)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach()


def assert_same_pipe_options(a: gpipe.Pipe, b: gpipe.Pipe) -> None:
    assert (a.balance, a.devices, a.chunks, a.checkpoint, a.tracing, a.training) == \
        (b.balance, b.devices, b.chunks, b.checkpoint, b.tracing, b.training)


def assert_independent_and_equal(pipe: gpipe.Pipe, other: gpipe.Pipe) -> None:
    """``other`` computes exactly what ``pipe`` does (outputs, input and parameter grads)
    and shares nothing with it: training ``other`` leaves ``pipe`` alone."""
    assert_same_pipe_options(pipe, other)
    assert list(other.state_dict()) == list(pipe.state_dict())
    for (n, p), (m, q) in zip(pipe.named_parameters(), other.named_parameters()):
        assert n == m and torch.equal(p, q)
        assert p is not q and p.data_ptr() != q.data_ptr(), f"{n} is shared"
    assert all(a is not b for a, b in zip(pipe, other))
    pipe.zero_grad(set_to_none=True)
    other.zero_grad(set_to_none=True)
    width = pipe[0].in_features
    x = x_of(8, width)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert torch.equal(run_step(pipe, xa), run_step(other, xb))
    assert torch.equal(xa.grad, xb.grad)
    assert_same_grads(other, pipe, tol=0.0)

    before = copy.deepcopy(pipe.state_dict())
    opt = torch.optim.SGD(other.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        run_step(other, x_of(8, width))
        opt.step()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, before[key]), f"training the copy changed the original's {key}"
    assert any(not torch.equal(v, before[k]) for k, v in other.state_dict().items())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_deepcopy_is_an_independent_working_pipe(checkpoint):
    pipe = gpipe.Pipe(mlp(), balance=[2, 3, 2], chunks=4, checkpoint=checkpoint)
    run_step(pipe, x_of(7, 5))   # a used Pipe copies too
    assert_independent_and_equal(pipe, copy.deepcopy(pipe))


def test_pickle_round_trip():
    pipe = gpipe.Pipe(mlp(), balance=[3, 4], chunks=3, checkpoint="always")
    pipe.eval()
    loaded = pickle.loads(pickle.dumps(pipe))
    assert isinstance(loaded, gpipe.Pipe) and not loaded.training
    pipe.train(), loaded.train()
    assert_independent_and_equal(pipe, loaded)


def test_torch_save_and_load(tmp_path):
    pipe = gpipe.Pipe(mlp(), balance=[1, 6], chunks=2, checkpoint="never", trace=True)
    path = tmp_path / "pipe.pt"
    torch.save(pipe, path)
    loaded = torch.load(path, weights_only=False)
    assert loaded.tracing and len(loaded.trace.events) == 0   # tracing on, a fresh record
    assert_independent_and_equal(pipe, loaded)
    assert len(loaded.trace.events) > 0


def bn_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(),
                         nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)),
                         nn.Linear(6, 3)).double()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_of_a_deferred_batch_norm_pipe(how):
    pipe = gpipe.Pipe(bn_model(), balance=[2, 3], chunks=4, deferred_batch_norm=True)
    x = torch.randn(12, 5, dtype=torch.float64) * 3 + 2
    run_step(pipe, x)
    other = copy.deepcopy(pipe) if how == "deepcopy" else pickle.loads(pickle.dumps(pipe))
    deferred = [m for m in other.modules() if isinstance(m, DeferredBatchNorm)]
    assert len(deferred) == 2 and other._deferred == deferred   # the copy's own layers
    for a, b in zip(pipe.buffers(), other.buffers()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    for _ in range(2):
        x = torch.randn(12, 5, dtype=torch.float64) * 3 + 2
        assert torch.equal(run_step(pipe, x), run_step(other, x))
    for (n, a), (_, b) in zip(pipe.named_buffers(), other.named_buffers()):
        assert torch.equal(a, b), f"{n} differs after training both"
    assert int(other[1].num_batches_tracked) == 3
    run_step(other, x)
    assert int(pipe[1].num_batches_tracked) == 3   # the original did not count the copy's step


# -- help() ---------------------------------------------------------------------

MODULE_TEXT = ["Initialize internal Module state", "Move all model parameters",
               "Compile this Module's forward", "pybind11"]


@pytest.mark.parametrize("name,own", [
    ("Pipe.__init__", "deferred_batch_norm"),
    ("Pipe.to", "stages"),
    ("Pipe.cpu", "stages"),
    ("Pipe.cuda", "stages"),
    ("Pipe.compile", "worker"),
    ("is_checkpointing", "checkpointed"),
    ("is_recomputing", "recompute"),
])
def test_help_shows_gpipes_own_text(name, own):
    obj: Any = gpipe
    for part in name.split("."):
        obj = getattr(obj, part)
    text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    for foreign in MODULE_TEXT:
        assert foreign not in text, f"help({name}) shows {foreign!r}:\n{text}"
    assert own in text, f"help({name}) lacks {own!r}:\n{text}"
    if name.startswith("is_"):
        assert f"{name}() -> bool" in text


def test_help_of_the_package_reads_well():
    text = pydoc.render_doc(gpipe, renderer=pydoc.plaintext)
    assert "pybind11_detail_function_record" not in text
    assert "is_checkpointing() -> bool" in text and "is_recomputing() -> bool" in text


def test_phase_flags_are_false_outside_a_pipe():
    assert gpipe.is_checkpointing() is False and gpipe.is_recomputing() is False


# -- forward hooks on recompute (documented) -------------------------------------

def test_forward_hooks_fire_again_on_recompute():
    """As with torch.utils.checkpoint, a checkpointed micro-batch runs its layers (and their
    hooks) twice: 4 micro-batches under except_last is 4 forwards + 3 recomputes = 7 calls.
    A hook that must run once per micro-batch skips ``gpipe.is_recomputing()``."""
    seq = model()
    every: List[bool] = []
    once: List[int] = []
    pre: List[bool] = []
    seq[2].register_forward_hook(lambda m, i, o: every.append(gpipe.is_recomputing()))
    seq[2].register_forward_hook(
        lambda m, i, o: None if gpipe.is_recomputing() else once.append(o.shape[0]))
    seq[2].register_forward_pre_hook(lambda m, i: pre.append(gpipe.is_recomputing()))
    pipe = gpipe.Pipe(seq, balance=[2, 3], chunks=4, checkpoint="except_last")
    out = pipe(x_of(8))
    assert every == [False] * 4 and once == [2] * 4
    out.sum().backward()
    assert len(every) == 7 and every.count(True) == 3
    assert pre == every   # pre-hooks (weight_norm's, say) run on recompute too, as they must
    assert once == [2] * 4


# -- deferred batch norm leaves the caller's model alone -------------------------

def test_deferred_batch_norm_does_not_touch_the_callers_model():
    seq = bn_model()
    children = list(seq)
    inner = list(seq[3])
    pipe = gpipe.Pipe(seq, balance=[2, 3], chunks=4, deferred_batch_norm=True)

    # The caller's Sequential and the containers inside it are as they were.
    assert all(a is b for a, b in zip(seq, children)) and len(seq) == len(children)
    assert all(a is b for a, b in zip(seq[3], inner)) and len(seq[3]) == len(inner)
    assert type(seq[1]) is nn.BatchNorm1d and type(seq[3][1]) is nn.BatchNorm1d
    # The Pipe runs converted BatchNorms; the containers holding one are its own copies,
    # every other layer is the caller's object (adopted, as without deferred_batch_norm).
    assert isinstance(pipe[1], DeferredBatchNorm) and isinstance(pipe[3][1], DeferredBatchNorm)
    assert pipe[3] is not seq[3] and pipe[3][0] is seq[3][0]
    assert pipe[0] is seq[0] and pipe[2] is seq[2] and pipe[4] is seq[4]
    # The converted layers share the originals' parameters and running statistics.
    for bn, old in ((pipe[1], seq[1]), (pipe[3][1], seq[3][1])):
        assert bn.weight is old.weight and bn.bias is old.bias
        assert bn.running_mean is old.running_mean and bn.running_var is old.running_var
        assert bn.num_batches_tracked is old.num_batches_tracked
    # Registering on the Pipe's copy of a container does not reach the caller's.
    pipe[3].register_forward_hook(lambda *a: None)
    assert not seq[3]._forward_hooks

    ref = copy.deepcopy(seq)
    x = torch.randn(12, 5, dtype=torch.float64) * 3 + 2
    run_step(pipe, x)
    ref(x)
    # The caller's model sees the once-per-mini-batch statistics, equal to a plain step's
    # (for the first BatchNorm: the second's input differs, each micro-batch having been
    # normalised by its own statistics).
    assert int(seq[1].num_batches_tracked) == int(seq[3][1].num_batches_tracked) == 1
    assert (seq[1].running_mean - ref[1].running_mean).abs().max().item() <= 1e-9
    assert (seq[1].running_var - ref[1].running_var).abs().max().item() <= 1e-9
    assert (seq[1].running_mean - 0).abs().max().item() > 1e-2


def test_convert_in_place_is_unchanged():
    """gpipe.batchnorm.DeferredBatchNorm.convert (torchgpipe's API) still converts in place."""
    seq = bn_model()
    out = DeferredBatchNorm.convert(seq, 4)
    assert out is seq and isinstance(seq[1], DeferredBatchNorm)
    assert isinstance(seq[3][1], DeferredBatchNorm)


# -- torch.compile --------------------------------------------------------------

# No torch._dynamo.reset() between these tests: with torch 2.11 on a CPU-only machine, a
# reset followed by a compile on a thread other than the main one segfaults inside dynamo's
# fake tensors (plain torch threads, no gpipe involved; cf. pytorch/pytorch#155057). Each
# test compiles with a backend object of its own, so none reuses another's graphs.

class RecordingBackend:
    """A torch.compile backend that runs the captured graph as is and records, per call,
    the thread that ran it: proof that compiled code runs, and where."""

    def __init__(self) -> None:
        self.graphs = 0
        self.threads: List[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.threads.append(threading.get_ident())
            return gm.forward(*args)

        return run


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_compile_runs_each_stage_compiled_on_its_worker(checkpoint):
    backend = RecordingBackend()
    seq = model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 3], chunks=4, checkpoint=checkpoint)
    keys = list(pipe.state_dict())
    assert pipe.compile(backend=backend) is None
    assert list(pipe.state_dict()) == keys and list(pipe) == list(seq)

    x = x_of(8).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, want = pipe(x), ref(x_ref)
    assert_close(out, want, what="compiled output")
    assert backend.graphs >= 2, f"{backend.graphs} graphs: expected one per stage (and mode)"
    assert len(backend.threads) == 8   # 2 stages x 4 micro-batches
    assert threading.get_ident() not in backend.threads, "compiled code ran on the caller"
    w = torch.randn(8, 2, dtype=torch.float64)
    (out * w).sum().backward()
    (want * w).sum().backward()
    assert_close(x.grad, x_ref.grad, what="input grad")
    assert_same_grads(pipe, ref)
    recomputes = {"always": 8, "except_last": 6, "never": 0}[checkpoint]
    assert len(backend.threads) == 8 + recomputes


def test_compile_aot_eager_is_transparent():
    """Compiled autograd graphs (aot_eager): outputs, input and parameter grads equal the
    plain model's."""
    seq = mlp()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[3, 4], chunks=2, checkpoint="except_last")
    pipe.compile(backend="aot_eager")
    x = torch.randn(8, 5, dtype=torch.float64)
    xp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = pipe(xp), ref(x_ref)
    assert_close(out, want, what="output")
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_close(xp.grad, x_ref.grad, what="input grad")
    assert_same_grads(pipe, ref)


def test_compiled_dropout_recompute_replays_the_masks():
    """Two Dropout(0.5) on ones, compiled: the input grad equals the output (the recompute
    draws the masks of the first forward)."""
    seq = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5), nn.Identity()).double()
    pipe = gpipe.Pipe(seq, balance=[2, 1], chunks=4, checkpoint="always")
    pipe.compile(backend="aot_eager")
    x = torch.ones(8, 16, dtype=torch.float64, requires_grad=True)
    out = pipe(x)
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())
    assert 0 < (out == 0).sum() < out.numel()


def test_torch_compile_of_the_pipe_warns_and_still_works():
    backend = RecordingBackend()
    seq = model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 3], chunks=2)
    compiled = torch.compile(pipe, backend=backend)
    x = x_of(4)
    with pytest.warns(UserWarning, match=r"pipe\.compile\("):
        out = compiled(x)
    assert_close(out, ref(x), what="output")
    assert all(t == threading.get_ident() for t in backend.threads), "a stage was compiled"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(x)   # the plain call does not warn


def test_copies_of_a_compiled_pipe_run_uncompiled():
    """As nn.Module.compile: a copy keeps the layers, not the compiled stages."""
    backend = RecordingBackend()
    pipe = gpipe.Pipe(model(), balance=[2, 3], chunks=2)
    pipe.compile(backend=backend)
    pipe(x_of(4))
    calls = len(backend.threads)
    other = copy.deepcopy(pipe)
    other(x_of(4))
    assert len(backend.threads) == calls
    assert_independent_and_equal(pipe, other)


@pytest.mark.skipif(not os.environ.get("GPIPE_SLOW_TESTS"),
                    reason="inductor compiles C++ (minutes); set GPIPE_SLOW_TESTS=1")
def test_compile_inductor_is_transparent():
    seq = mlp()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[3, 4], chunks=2, checkpoint="except_last")
    pipe.compile()   # the default backend: inductor
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, want = pipe(x), ref(x_ref)
    assert_close(out, want, what="output")
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_close(x.grad, x_ref.grad, what="input grad")
    assert_same_grads(pipe, ref)


_RECOMPILE_SCRIPT = """
import torch, gpipe
from torch import nn
for width in (4, 5):
    seq = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2)).double()
    pipe = gpipe.Pipe(seq, balance=[1, 2], chunks=2)
    pipe.compile(backend="eager")
    pipe(torch.randn(4, 3, dtype=torch.float64, requires_grad=True)).sum().backward()
    del pipe   # its workers exit
print("survived")
"""


def test_compiling_again_after_a_compiled_pipe_is_gone():
    """Pipes compiled one after another, each dropped before the next: on a machine without
    CUDA, torch's no-op CUDA guard must not belong to a worker that has exited (it would
    segfault). Run in a subprocess: the failure mode takes the process down."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _RECOMPILE_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "survived" in proc.stdout, (
        f"exit code {proc.returncode}; stderr:\n{proc.stderr[-2000:]}")
