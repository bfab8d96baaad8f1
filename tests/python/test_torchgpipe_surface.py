"""The rest of torchgpipe 0.0.7's public surface: pipe.partitions, its checkpoints, DeferredBatchNorm's API,
and tied weights across devices refused."""
import copy
import pickle
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import gpipe
from gpipe.batchnorm import DeferredBatchNorm
from gpipe.pipe import _tie_across_devices

TGP = Path("/tmp/tgp")  # torchgpipe 0.0.7, installed with pip --target (optional)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 6), nn.BatchNorm1d(6),
                         nn.Linear(6, 2)).double()


# 1. pipe.partitions ------------------------------------------------------------------------------

def test_partitions_holds_each_stages_layers_in_order() -> None:
    seq = model()
    layers = list(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 1, 2], devices="cpu")
    parts = pipe.partitions
    assert isinstance(parts, nn.ModuleList)
    assert len(parts) == len(pipe.balance) == 3
    assert all(isinstance(p, nn.Sequential) for p in parts)
    assert [list(p) for p in parts] == [layers[0:2], layers[2:3], layers[3:5]]
    assert all(a is b for p, want in zip(parts, [layers[0:2], layers[2:3], layers[3:5]])
               for a, b in zip(p, want))
    # Under the Sequential's own names, as torchgpipe's partitions.
    assert [list(p._modules) for p in parts] == [["0", "1"], ["2"], ["3", "4"]]


def test_partitions_changes_neither_state_dict_nor_modules() -> None:
    pipe = gpipe.Pipe(model(), balance=[2, 1, 2], devices="cpu")
    keys = list(pipe.state_dict())
    modules = [(n, id(m)) for n, m in pipe.named_modules()]
    children = list(pipe._modules)
    for _ in range(2):
        parts = pipe.partitions
        parts[0][0]
    assert list(pipe.state_dict()) == keys
    assert keys[0] == "0.weight"
    assert [(n, id(m)) for n, m in pipe.named_modules()] == modules
    assert list(pipe._modules) == children
    assert "partitions" not in pipe._modules


def test_partitions_is_read_only() -> None:
    pipe = gpipe.Pipe(model(), balance=[2, 1, 2], devices="cpu")
    parts = pipe.partitions
    for change in (lambda: parts.append(nn.ReLU()), lambda: parts[0].append(nn.ReLU()),
                   lambda: parts.insert(0, nn.ReLU()), lambda: parts[0].insert(0, nn.ReLU()),
                   lambda: parts.__setitem__(0, nn.Sequential()),
                   lambda: parts[1].__setitem__(0, nn.ReLU()),
                   lambda: parts[0].__delitem__(0), lambda: parts.__delitem__(0),
                   lambda: parts[0].add_module("x", nn.ReLU()),
                   lambda: setattr(parts[0], "x", nn.ReLU())):
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert [len(p) for p in pipe.partitions] == [2, 1, 2]


def test_hooks_on_partitions_are_refused_naming_the_layer_to_hook() -> None:
    # torchgpipe runs each partition's Sequential, so its hooks fire; gpipe runs the
    # layers, and the view is rebuilt at each access: a hook on it would never run.
    pipe = gpipe.Pipe(model(), balance=[2, 1, 2], devices="cpu")
    parts = pipe.partitions
    hook = lambda *args: None  # noqa: E731
    for register in (parts[0].register_forward_hook, parts[0].register_forward_pre_hook,
                     parts[1].register_full_backward_hook,
                     parts[1].register_full_backward_pre_hook, parts[2].register_backward_hook,
                     parts.register_forward_hook):
        with pytest.raises(TypeError, match=r"never run.*pipe\.partitions\[j\]\[-1\]"):
            register(hook)
    # On a layer it runs, as on the plain model's.
    seen = []
    parts[0][-1].register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    pipe(torch.randn(6, 4, dtype=torch.float64))
    assert sum(seen) == 6


def test_partitions_refuses_moving_a_stage() -> None:
    pipe = gpipe.Pipe(model(), balance=[2, 1, 2], devices="cpu")
    with pytest.raises(TypeError, match="denied to move"):
        pipe.partitions[0].to("meta")
    pipe.partitions[0].to("cpu")  # where it is: nothing moves
    assert pipe[0].weight.device.type == "cpu"


def test_partitions_after_deepcopy_and_pickle() -> None:
    pipe = gpipe.Pipe(model(), balance=[2, 1, 2], devices="cpu")
    for other in (copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe))):
        assert len(other.partitions) == 3
        assert other.partitions[2][1] is other[4]
        assert other.partitions[2][1] is not pipe[4]


def test_partitions_with_virtual_stages() -> None:
    seq = model()
    layers = list(seq)[:4]
    pipe = gpipe.Pipe(nn.Sequential(*layers), balance=[1, 1, 1, 1], devices=["cpu", "cpu"],
                      schedule="interleaved_1f1b", virtual_stages=2)
    assert len(pipe.devices) == 2
    assert len(pipe.partitions) == 4
    assert [p[0] for p in pipe.partitions] == layers


def test_partitions_of_an_empty_pipe() -> None:
    assert len(gpipe.Pipe(nn.Sequential()).partitions) == 0


def test_attributes_have_torchgpipes_types() -> None:
    pipe = gpipe.Pipe(model(), [2, 3], devices=["cpu", "cpu", "cpu"], chunks=3,
                      checkpoint="never")
    assert type(pipe.devices) is list and all(type(d) is torch.device for d in pipe.devices)
    assert pipe.devices == [torch.device("cpu")] * 2  # extra devices dropped, as torchgpipe
    assert type(pipe.balance) is list and all(type(b) is int for b in pipe.balance)
    assert pipe.balance == [2, 3]
    assert type(pipe.chunks) is int and pipe.chunks == 3
    assert type(pipe.checkpoint) is str and pipe.checkpoint == "never"


def test_partitions_is_documented() -> None:
    assert "partitions" in (gpipe.Pipe.__doc__ or "")
    assert gpipe.Pipe.partitions.__doc__


# 2. torchgpipe checkpoints -----------------------------------------------------------------------

def torchgpipe_state_dict(seq: nn.Sequential, balance) -> "OrderedDict[str, torch.Tensor]":
    """What torchgpipe 0.0.7 saves: each stage an nn.Sequential of the layers under
    their own names, in an nn.ModuleList called partitions (keys partitions.J.NAME.rest)."""
    names = list(seq._modules.items())
    parts, offset = [], 0
    for n in balance:
        parts.append(nn.Sequential(OrderedDict(names[offset:offset + n])))
        offset += n
    holder = nn.Module()
    holder.partitions = nn.ModuleList(parts)
    return holder.state_dict()


def test_torchgpipe_keys_are_the_layer_names() -> None:
    sd = torchgpipe_state_dict(model(), [2, 3])
    assert "partitions.1.2.weight" in sd and "partitions.0.0.weight" in sd


def test_convert_maps_keys_to_the_sequentials() -> None:
    seq = model()
    sd = torchgpipe_state_dict(seq, [2, 3])
    sd["step"] = torch.tensor(7)  # a key outside partitions passes through
    got = gpipe.convert_torchgpipe_state_dict(sd, balance=[2, 3])
    want = OrderedDict(seq.state_dict())
    want["step"] = torch.tensor(7)
    assert list(got) == list(want)
    assert all(got[k] is sd["partitions." + str(0 if k.split(".")[0] in ("0", "1") else 1) + "."
                            + k] for k in want if k != "step")
    # Without the balance, the names alone say where each key goes.
    assert list(gpipe.convert_torchgpipe_state_dict(sd)) == list(want)


def test_load_into_a_pipe_of_another_balance() -> None:
    src = model()
    for p in src.parameters():
        p.data.normal_()
    src[3].running_mean.normal_()
    sd = torchgpipe_state_dict(src, [2, 3])
    torch.manual_seed(1)
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 6),
                                    nn.BatchNorm1d(6), nn.Linear(6, 2)).double(),
                      balance=[1, 1, 3], devices="cpu")
    assert not torch.equal(pipe[0].weight, src[0].weight)
    result = gpipe.load_torchgpipe_state_dict(pipe, sd)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    for (name, got), (_, want) in zip(pipe.state_dict().items(), src.state_dict().items()):
        assert torch.equal(got, want), name


def test_load_drops_deferred_batch_norm_sums() -> None:
    """torchgpipe's DeferredBatchNorm keeps its sums as buffers (sum, sum_squares);
    ours keeps them elsewhere, so they are dropped, not refused as unexpected."""
    src = model()
    sd = torchgpipe_state_dict(src, [2, 3])
    sd["partitions.1.3.sum"] = torch.zeros(6, dtype=torch.float64)
    sd["partitions.1.3.sum_squares"] = torch.zeros(6, dtype=torch.float64)
    for deferred in (False, True):
        pipe = gpipe.Pipe(model(), balance=[2, 3], devices="cpu", chunks=2,
                          deferred_batch_norm=deferred)
        result = gpipe.load_torchgpipe_state_dict(pipe, sd)
        assert list(result.unexpected_keys) == []
    # Elsewhere such a key is unexpected, as any other.
    sd["partitions.0.0.sum"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"0\.sum"):
        gpipe.load_torchgpipe_state_dict(gpipe.Pipe(model(), [2, 3], devices="cpu"), sd)


def test_load_strict_false_reports_missing_keys() -> None:
    sd = torchgpipe_state_dict(model(), [2, 3])
    del sd["partitions.1.4.bias"]
    pipe = gpipe.Pipe(model(), [2, 3], devices="cpu")
    with pytest.raises(RuntimeError, match=r"4\.bias"):
        gpipe.load_torchgpipe_state_dict(pipe, sd)
    result = gpipe.load_torchgpipe_state_dict(pipe, sd, strict=False)
    assert list(result.missing_keys) == ["4.bias"]


def test_convert_refuses_keys_outside_the_balance() -> None:
    sd = torchgpipe_state_dict(model(), [2, 3])
    with pytest.raises(ValueError, match=r"partitions\.1\.2\.weight.*stage 1.*balance \[2\]"):
        gpipe.convert_torchgpipe_state_dict(sd, balance=[2])
    with pytest.raises(ValueError, match=r"partitions\.1\.2\.weight.*layer 2.*layers 3 to 4"):
        gpipe.convert_torchgpipe_state_dict(sd, balance=[3, 2])
    bad = OrderedDict([("partitions.1.0.weight", torch.zeros(1))])  # not how 0.0.7 names it
    with pytest.raises(ValueError, match=r"partitions\.1\.0\.weight.*layers 2 to 4.*balance"):
        gpipe.convert_torchgpipe_state_dict(bad, balance=[2, 3])


def test_convert_refuses_malformed_and_clashing_keys() -> None:
    for key in ("partitions.x.0.weight", "partitions.0", "partitions.0.weight"):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            gpipe.convert_torchgpipe_state_dict(OrderedDict([(key, torch.zeros(1))]))
    clash = OrderedDict([("partitions.0.0.weight", torch.zeros(1)), ("0.weight", torch.ones(1))])
    with pytest.raises(ValueError, match=r"0\.weight.*twice"):
        gpipe.convert_torchgpipe_state_dict(clash)


def test_convert_keeps_metadata_for_batch_norm_versions() -> None:
    sd = torchgpipe_state_dict(model(), [2, 3])
    got = gpipe.convert_torchgpipe_state_dict(sd)
    assert got._metadata["3"] == sd._metadata["partitions.1.3"]  # type: ignore[attr-defined]
    assert "partitions" not in got._metadata  # type: ignore[attr-defined]


def test_a_real_torchgpipe_checkpoint_loads(tmp_path: Path) -> None:
    """Saved by torchgpipe 0.0.7 itself, in a subprocess, when it is installed."""
    if not (TGP / "torchgpipe").is_dir():
        pytest.skip("torchgpipe 0.0.7 not at /tmp/tgp (pip install --target /tmp/tgp "
                    "torchgpipe==0.0.7)")
    path = tmp_path / "tgp.pt"
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(TGP)!r})\n"
        "import torchgpipe\n"
        "from torch import nn\n"
        "m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 6), nn.BatchNorm1d(6),\n"
        "                  nn.Linear(6, 2)).double()\n"
        "for p in m.parameters(): p.data.normal_()\n"
        "g = torchgpipe.GPipe(m, balance=[2, 3], devices=['cpu', 'cpu'], chunks=2,\n"
        "                     deferred_batch_norm=True)\n"
        "g(torch.randn(4, 4, dtype=torch.float64)).sum().backward()\n"
        f"torch.save(g.state_dict(), {str(path)!r})\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    if run.returncode != 0 and "import torchgpipe" in run.stderr:
        pytest.skip(f"torchgpipe does not import here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr
    sd = torch.load(path)
    assert "partitions.1.3.weight" in sd and "partitions.1.3.sum" in sd
    pipe = gpipe.Pipe(model(), balance=[3, 2], devices="cpu", chunks=2, deferred_batch_norm=True)
    gpipe.load_torchgpipe_state_dict(pipe, sd)
    for name, value in pipe.state_dict().items():
        J = 0 if int(name.split(".")[0]) < 2 else 1
        assert torch.equal(value, sd[f"partitions.{J}.{name}"]), name
    assert int(pipe[3].num_batches_tracked) == 1


# 3. DeferredBatchNorm's torchgpipe API -----------------------------------------------------------

def test_deferred_batch_norm_takes_chunks() -> None:
    bn = DeferredBatchNorm(6, eps=1e-3, momentum=0.2, affine=False, chunks=4)
    assert bn.chunks == 4 and bn.microbatches == 4
    assert bn.eps == 1e-3 and bn.momentum == 0.2 and not bn.affine
    assert DeferredBatchNorm(6).chunks == 1


def test_convert_deferred_batch_norm_is_convert() -> None:
    assert DeferredBatchNorm.convert_deferred_batch_norm.__doc__
    ours, theirs = model(), model()
    a = DeferredBatchNorm.convert(ours, 4)
    b = DeferredBatchNorm.convert_deferred_batch_norm(theirs, chunks=4)
    assert a is ours and b is theirs  # containers converted in place, as torchgpipe
    assert isinstance(b[3], DeferredBatchNorm) and b[3].chunks == 4
    bn = nn.BatchNorm1d(6)
    converted = DeferredBatchNorm.convert_deferred_batch_norm(bn, 2)
    assert isinstance(converted, DeferredBatchNorm) and converted.weight is bn.weight
    # The same numerics: train both on the same micro-batches.
    torch.manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 4, dtype=torch.float64) * 3 + 1
        for m in (a, b):
            m[3].begin(4)
            for part in x.chunk(4):
                m(part)
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
    assert int(b[3].num_batches_tracked) == 3


def test_converting_a_deferred_batch_norm_again_changes_its_chunks() -> None:
    # torchgpipe: the same count returns the module itself; another count gives a new one
    # for that count (sharing the tensors), so a model converted for 4 micro-batches and
    # converted again for 5 commits its statistics after 5, not 4.
    dbn = DeferredBatchNorm(3, chunks=4)
    assert DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=4) is dbn
    again = DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=5)
    assert again is not dbn and isinstance(again, DeferredBatchNorm)
    assert again.chunks == 5 and dbn.chunks == 4
    assert again.weight is dbn.weight and again.bias is dbn.bias
    assert again.running_mean is dbn.running_mean and again.running_var is dbn.running_var
    seq = nn.Sequential(nn.Linear(2, 3), DeferredBatchNorm(3, chunks=2))
    old = seq[1]
    assert DeferredBatchNorm.convert(seq, 3) is seq  # in place, as torchgpipe
    assert seq[1] is not old and seq[1].microbatches == 3 and seq[1].weight is old.weight
    # Trained alone on 3 micro-batches, it commits once, after the third.
    x = torch.randn(6, 2)
    for part in x.chunk(3):
        seq(part)
    assert int(seq[1].num_batches_tracked) == 1
    ref = nn.BatchNorm1d(3)
    ref(seq[0](x))
    assert torch.allclose(seq[1].running_mean, ref.running_mean, atol=1e-6)
    assert torch.allclose(seq[1].running_var, ref.running_var, atol=1e-6)


# 4. tied weights across devices ------------------------------------------------------------------

def tied_model() -> nn.Sequential:
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), last).double()


def test_shared_parameter_on_one_device_works() -> None:
    seq = tied_model()
    ref = copy.deepcopy(seq)
    pipe = gpipe.Pipe(seq, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(5, 4, dtype=torch.float64)
    (ref(x) ** 2).sum().backward()
    (pipe(x) ** 2).sum().backward()
    assert (pipe[0].weight.grad - ref[0].weight.grad).abs().max().item() <= 1e-10


def test_check_tied_across_devices_directly() -> None:
    """A parameter tied across devices is accepted (test_ties.py trains with one); a buffer
    is refused."""
    cpu, other = torch.device("cpu"), torch.device("cuda", 1)
    seq = tied_model()
    for devices in ([cpu, cpu, cpu], [cpu, other, cpu], [cpu, cpu, other]):
        _tie_across_devices(seq, list(seq), devices, install=False)
    a, b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    b.register_buffer("running_mean", a.running_mean)
    with pytest.raises(ValueError, match=r"buffer '1\.running_mean'.*'0\.running_mean'"):
        _tie_across_devices(nn.Sequential(a, b), [a, b], [cpu, other], install=False)
    # Shared inside one layer (or between layers on one device) is fine.
    _tie_across_devices(nn.Sequential(a, b), [a, b], [other, other], install=False)
