"""gpipe.pipeline: a traced nn.Module cut at named submodules equals the module (outputs, grads,
state_dict, ties, kwargs, batch sizes) and refuses what it cannot trace, naming the line."""
import collections
import copy
import math
import pickle
import time
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import gpipe
from conftest import TOL, max_diff

torch.set_num_threads(1)

V, C, T, H = 11, 8, 5, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(b, t, H, c // H).transpose(1, 2)
        k = k.view(b, t, H, c // H).transpose(1, 2)
        v = v.view(b, t, H, c // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // H)
        att = att.masked_fill(mask[:t, :t] == 0, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(C), Attention()
        self.ln2, self.mlp = nn.LayerNorm(C), nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(),
                                                            nn.Linear(4 * C, C))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Written the usual way: tok + pos embeddings, blocks in a ModuleList, tied lm_head."""

    def __init__(self, n_layer: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.pos = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        if attention_mask is None:
            attention_mask = torch.ones(t, t, device=idx.device).tril()
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.lm_head(self.ln_f(x))


class UNet(nn.Module):
    """Encoder outputs joined (torch.cat) into decoder layers later on."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU())
        self.mid = nn.Conv1d(8, 8, 3, padding=1)
        self.dec2 = nn.Conv1d(16, 4, 3, padding=1)
        self.dec1 = nn.Conv1d(8, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool1d(e1, 2))
        m = self.mid(e2)
        d2 = self.dec2(torch.cat([m, e2], dim=1))
        up = F.interpolate(d2, scale_factor=2.0)
        return self.dec1(torch.cat([up, e1], dim=1))


def gpt() -> GPT:
    return GPT().double()


def idx_of(rows: int) -> Tensor:
    return torch.randint(0, V, (rows, T))


def causal() -> Tensor:
    return torch.ones(T, T, dtype=torch.float64).tril()


def grads_equal(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        if pa[name].grad is None and pb[name].grad is None and "unused" in name:
            continue
        assert max_diff(pa[name].grad, pb[name].grad) < TOL, name


def outputs_and_grads_equal(out: Tensor, ref: Tensor, model: nn.Module,
                            plain: nn.Module) -> None:
    """The pipe's ``out`` equals the plain model's ``ref``, and after the same weighted
    backward through both, ``model``'s grads equal ``plain``'s."""
    assert max_diff(out, ref) < TOL
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    grads_equal(model, plain)


def lm_loss(logits: Tensor, tgt: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))


def train_step_equals_plain(pipe: nn.Module, model: nn.Module, plain: nn.Module, args: tuple,
                            target: Tensor, loss_fn: Callable, kwargs: Optional[dict] = None,
                            what: Any = None) -> None:
    """pipe.train_step on ``args``/``kwargs`` gives the plain model's loss, and ``model``'s
    grads equal ``plain``'s after its backward."""
    kwargs = kwargs or {}
    loss = pipe.train_step(args, target, loss_fn, kwargs=kwargs) if kwargs else \
        pipe.train_step(args[0] if len(args) == 1 else args, target, loss_fn)
    ref = loss_fn(plain(*args, **kwargs), target)
    ref.backward()
    assert abs(loss.item() - ref.item()) < TOL, what
    grads_equal(model, plain)


def twin(model: nn.Module) -> nn.Module:
    """An independent copy (the pipe shares the model's own parameters)."""
    import copy
    return copy.deepcopy(model)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_gpt_outputs_and_grads(checkpoint: str, chunks: int) -> None:
    model = gpt()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], (idx_of(2),), chunks=chunks,
                          checkpoint=checkpoint)
    assert len(pipe) == 3
    idx = idx_of(7)  # uneven micro-batches with chunks 2..4; not the example's batch size
    out = pipe(idx)
    ref = plain(idx)
    outputs_and_grads_equal(out, ref, model, plain)


def test_gpt_train_step() -> None:
    model = gpt()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], idx_of(3), chunks=3)
    train_step_equals_plain(pipe, model, plain, (idx_of(7),), idx_of(7), lm_loss)


def test_gpt_tied_weight_stays_one_parameter() -> None:
    model = gpt()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], idx_of(2), chunks=2)
    params = list(pipe.parameters())
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert {id(p) for p in params} == {id(p) for p in model.parameters()}  # shared, not copied
    assert pipe[0].tok.weight is pipe[2].lm_head.weight is model.tok.weight
    idx = idx_of(4)
    pipe(idx).sum().backward()
    plain(idx).sum().backward()
    assert max_diff(model.tok.weight.grad, plain.tok.weight.grad) < TOL


def test_gpt_state_dict_keys_and_loading() -> None:
    model = gpt()
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], idx_of(2))
    assert list(pipe.state_dict().keys()) == list(model.state_dict().keys())
    other = gpt()  # different weights
    other.load_state_dict(pipe.state_dict())
    idx = idx_of(3)
    assert max_diff(other(idx), pipe(idx)) < TOL
    fresh = gpt()
    pipe.load_state_dict(fresh.state_dict())  # strict
    assert max_diff(pipe(idx), fresh(idx)) < TOL
    assert torch.equal(model.blocks[2].attn.qkv.weight, fresh.blocks[2].attn.qkv.weight)
    partial = fresh.state_dict()
    del partial["tok.weight"], partial["lm_head.weight"], partial["ln_f.bias"]
    result = pipe.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == ["lm_head.weight", "ln_f.bias", "tok.weight"]
    assert result.unexpected_keys == []
    with pytest.raises(RuntimeError, match="Missing key") as info:
        pipe.load_state_dict(partial)
    assert '"ln_f.bias"' in str(info.value) and '"tok.weight"' in str(info.value)


@pytest.mark.parametrize("batch_dim", [[0, None], {"attention_mask": None}])
def test_gpt_keyword_mask_not_cut(batch_dim: object) -> None:
    model = gpt()
    plain = twin(model)
    mask = causal()
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], (idx_of(2),),
                          {"attention_mask": mask}, chunks=4, batch_dim=batch_dim)
    assert pipe.input_names == ["idx", "attention_mask"]
    idx = idx_of(6)
    w = torch.randn(6, T, V, dtype=torch.float64)
    out = pipe(idx, attention_mask=mask)
    assert max_diff(out, plain(idx, attention_mask=mask)) < TOL
    assert max_diff(pipe(idx, mask), out) < TOL  # positionally too
    (out * w).sum().backward()
    (plain(idx, attention_mask=mask) * w).sum().backward()
    grads_equal(model, plain)
    with pytest.raises(TypeError, match="called without"):
        pipe(idx)


def test_batch_size_not_fixed_one_row_micro_batches() -> None:
    model = gpt()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], idx_of(5), chunks=4)
    for rows in (1, 3, 4, 9):  # 1 and 3 rows: one-row micro-batches
        idx = idx_of(rows)
        assert max_diff(pipe(idx), plain(idx)) < TOL
    shorter = idx_of(2)[:, :3]  # nor the sequence length
    assert max_diff(pipe(shorter), plain(shorter)) < TOL


# nanoGPT's forward begins with an assert on a traced size. pytest rewrites the asserts of
# test modules into other bytecode, so this forward is compiled here, as a library's is.
_ASSERTING = """
def forward(self, idx, attention_mask=None):
    b, t = idx.size()
    assert t <= self.pos.num_embeddings, f"sequence of {t} tokens is too long"
    return GPT.forward(self, idx, attention_mask)
"""


class AssertingGPT(GPT):
    scope: dict = {"GPT": GPT}
    exec(compile(_ASSERTING, "asserting_gpt.py", "exec"), scope)
    forward = scope["forward"]


def test_an_assert_on_a_traced_size_is_traced() -> None:
    model = AssertingGPT().double()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["blocks.2"], idx_of(2), chunks=2)
    idx = idx_of(3)
    assert max_diff(pipe(idx), plain(idx)) < TOL
    with pytest.raises(AssertionError, match="assertion failed at asserting_gpt.py:4"):
        pipe(torch.randint(0, V, (2, T + 1)))


# e1 (enc1's output) is used in stage 0 (the max-pool before enc2) and by the last torch.cat,
# in stage 2: it goes there as a skip, past stage 1, which never holds it.
@pytest.mark.parametrize("split,skips", [
    (["enc2", "dec2"], [([(None, "enc1>2")], []), None, ([], [(None, "enc1>2")])]),
    (["enc2", "mid", "dec1"], [([(None, "enc1>2")], []), None, ([], [(None, "enc1>2")]), None]),
])
def test_unet_skips_cross_stages(split: list, skips: list) -> None:
    model = UNet().double()
    plain = twin(model)
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    pipe = gpipe.pipeline(model, split, x, chunks=3)
    assert len(pipe) == len(split) + 1
    assert [stage.gpipe_skips for stage in pipe] == skips
    outputs_and_grads_equal(pipe(x), plain(x), model, plain)
    assert list(pipe.state_dict()) == list(model.state_dict())
    copied = pickle.loads(pickle.dumps(pipe))
    assert [stage.gpipe_skips for stage in copied] == skips
    assert max_diff(copied(x), plain(x)) < TOL


class Far(nn.Module):
    """x reaches stages 2 and 4 (skips 0 -> 2 -> 4); h is used by stages 1 and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)
        self.e = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        g = self.b(h)
        g = self.c(g) * x
        g = self.d(g)
        return self.e(g) + h + x


class Bypassed(nn.Module):
    """Cut at b, c, d: stage 2 uses nothing of stage 1 (h comes from stage 0, g goes on to
    stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        g = self.b(x)
        k = self.c(h)
        return self.d(k) + g


def test_a_stage_using_nothing_of_the_one_before_gets_carried_values() -> None:
    # Stage 1 hands stage 2 nothing of its own, and a stage's input cannot be empty: h rides
    # through stage 1 instead of skipping it (docs/pipeline.md).
    model = Bypassed().double()
    plain = twin(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["b", "c", "d"], x, chunks=2)
    assert [stage.gpipe_skips for stage in pipe] == [None] * 4
    outputs_and_grads_equal(pipe(x), plain(x), model, plain)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_values_skip_the_stages_that_do_not_use_them(schedule: str, checkpoint: str) -> None:
    model = Far().double()
    plain = twin(model)
    x = torch.randn(7, 4, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["b", "c", "d", "e"], x, chunks=3, schedule=schedule,
                          checkpoint=checkpoint)
    popped = [[name for _, name in stage.gpipe_skips[1]] if stage.gpipe_skips else []
              for stage in pipe]
    assert popped == [[], [], ["x>2"], [], ["x>4", "tanh>4"]]
    assert max_diff(pipe(x), plain(x)) < TOL
    train_step_equals_plain(pipe, model, plain, (x,), torch.randn(7, 4, dtype=torch.float64),
                            F.mse_loss, what=schedule)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = -h
        return self.b(h)


def test_untraceable_names_the_line_and_the_fallback() -> None:
    from gpipe.pipeline import PipelineError
    assert issubclass(PipelineError, RuntimeError)
    with pytest.raises(PipelineError) as info:
        gpipe.pipeline(DataDependent(), ["b"], torch.randn(2, 3), tracer="fx")
    text = str(info.value)
    assert "if h.sum() > 0:" in text and "test_pipeline.py:" in text
    assert "nn.Sequential" in text and "submodule" in text
    assert "tracer='export'" in text  # the other way, named


def test_untraceable_by_both_tracers_names_both_attempts() -> None:
    # Issue 45: the default (tracer="auto") tries torch.fx, then torch.export; when both stop,
    # the error names both, the line each stopped at, and each one's fix.
    from gpipe.pipeline import PipelineError
    with pytest.raises(PipelineError) as info:
        gpipe.pipeline(DataDependent(), ["b"], torch.randn(2, 3))
    text = str(info.value)
    line = f"test_pipeline.py:{DataDependent.forward.__code__.co_firstlineno + 2}"
    fx_part, _, export_part = text.partition("torch.export stopped")
    assert "torch.fx stopped" in fx_part and line in fx_part and "if h.sum() > 0:" in fx_part
    assert line in export_part and "if h.sum() > 0:" in export_part
    assert "For torch.fx, move that code into a submodule that contains no split point" in text
    assert "for torch.export (tracer='export'), make that code depend on sizes" in text
    assert "nn.Sequential" in text


def test_auto_does_not_export_with_deferred_batch_norm_and_says_so() -> None:
    from gpipe.pipeline import PipelineError
    with pytest.raises(PipelineError, match=r"if h.sum\(\) > 0:.*; torch.export was not tried: "
                                            r"deferred_batch_norm=True needs BatchNorm"):
        gpipe.pipeline(DataDependent(), ["b"], torch.randn(2, 3), deferred_batch_norm=True)


class Wrapped(nn.Module):
    """The same control flow inside a submodule with no split point: called, not traced."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.b = DataDependent(), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.inner(x))


def test_untraceable_region_inside_one_submodule_works() -> None:
    model = Wrapped().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    # chunks=1: the branch reads the whole batch's sum, which micro-batches would each
    # decide for themselves (as in any gpipe.Pipe).
    pipe = gpipe.pipeline(model, ["b"], x, chunks=1)
    assert max_diff(pipe(x), model(x)) < TOL


def test_bad_split_points() -> None:
    with pytest.raises(ValueError, match="blocks.1"):
        gpipe.pipeline(gpt(), ["block.1"], idx_of(2))
    with pytest.raises(ValueError, match="balance"):
        gpipe.pipeline(gpt(), ["blocks.1"], idx_of(2), balance=[1, 1])
    with pytest.raises(TypeError, match="example_kwargs"):
        gpipe.pipeline(gpt(), ["blocks.1"], idx_of(2), attention_mask=causal())
    with pytest.raises(ValueError, match="never used"):
        gpipe.pipeline(FunctionalHead(), ["unused"], idx_of(2))
    with pytest.raises(RuntimeError, match=r"DataDependent.forward: `if h.sum\(\) > 0:` "
                                           r"\('inner' is traced because it contains"):
        gpipe.pipeline(Wrapped(), ["inner.b"], torch.randn(2, 3))


class FunctionalHead(nn.Module):
    """The tie written functionally (x @ tok.weight.T), a dict output, a non-tensor flag, a
    submodule returning a tuple split across stages, an unused layer, a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.pair = Pair()
        self.mid = nn.Linear(C, C)
        self.last = nn.Linear(C, C)
        self.unused = nn.Linear(2, 2)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)
        self.register_buffer("shift", torch.tensor(0.25))

    def forward(self, idx: Tensor, double: bool = False) -> dict:
        a, b = self.pair(self.tok(idx))
        h = self.mid(a) * self.scale
        h = self.last(h + b) + self.shift
        if double:
            h = h * 2
        return {"logits": h @ self.tok.weight.t(), "hidden": h, "rows": 1}


class Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple:
        return x.tanh(), x.sigmoid()


def test_functional_tie_dict_output_flag_unused_and_buffers() -> None:
    model = FunctionalHead().double()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["mid", "last"], idx_of(2), {"double": True}, chunks=3)
    assert pipe.input_names == ["idx"]
    idx = idx_of(5)
    out, ref = pipe(idx, double=True), plain(idx, double=True)
    assert out.keys() == ref.keys() and out["rows"] == 1
    assert max_diff(out["logits"], ref["logits"]) < TOL
    assert max_diff(out["hidden"], ref["hidden"]) < TOL
    w = torch.randn_like(out["logits"])
    (out["logits"] * w).sum().backward()
    (ref["logits"] * w).sum().backward()
    grads_equal(model, plain)  # tok.weight's grad sums the embedding's and the head's
    assert len(list(pipe.parameters())) == len(list(model.parameters()))
    assert list(pipe.state_dict()) == list(model.state_dict())  # "unused.*" kept, "scale" not
    assert "scale" not in pipe.state_dict()
    with pytest.raises(TypeError, match="double=True"):
        pipe(idx)  # traced with double=True; the default False would be another graph


Pair2 = collections.namedtuple("Pair2", ["out", "mid"])


class Containers(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Any:
        h = self.a(x)
        out = self.b(h)
        if self.kind == "dict":
            return {"out": out, "mid": h}
        if self.kind == "list":
            return [out, h]
        return Pair2(out, h)


@pytest.mark.parametrize("kind", ["dict", "list", "namedtuple"])
def test_outputs_keep_the_modules_containers(kind: str) -> None:
    # fx records a returned dict as its immutable_dict: the pipe returns the module's own type.
    model = Containers(kind).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["b"], x, chunks=2)
    got, want = pipe(x), model(x)
    assert type(got) is type(want)
    assert pytree.tree_structure(got) == pytree.tree_structure(want)
    assert all(max_diff(g, w) < TOL for g, w in zip(pytree.tree_leaves(got),
                                                     pytree.tree_leaves(want)))
    if kind == "dict":
        got["extra"] = got["out"]  # a plain dict: the caller may add to it


def test_pickle_round_trip() -> None:
    import io
    model = gpt()
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], idx_of(2), chunks=2)
    for _ in range(2):  # an unpickled pipe pickles again
        buffer = io.BytesIO()
        torch.save(pipe, buffer)
        buffer.seek(0)
        pipe = torch.load(buffer, weights_only=False)
    idx = idx_of(3)
    assert max_diff(pipe(idx), model(idx)) < TOL
    assert pipe[0].tok.weight is pipe[2].lm_head.weight
    import copy
    dict_pipe = gpipe.pipeline(FunctionalHead().double(), ["mid"], idx_of(2))
    out, ref = copy.deepcopy(dict_pipe)(idx), dict_pipe(idx)
    assert out.keys() == ref.keys() and max_diff(out["logits"], ref["logits"]) < TOL


def test_train_step_with_keyword_mask_and_schedules() -> None:
    mask = causal()
    for schedule in ["1f1b", "gpipe", "zb_h1"]:
        model = gpt()
        plain = twin(model)
        pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], idx_of(2),
                              {"attention_mask": mask}, chunks=4,
                              batch_dim={"attention_mask": None}, schedule=schedule)
        train_step_equals_plain(pipe, model, plain, (idx_of(7),), idx_of(7), lm_loss,
                                kwargs={"attention_mask": mask}, what=schedule)


def test_state_dict_keys_inside_a_parent_module() -> None:
    model = gpt()
    parent = nn.Module()
    parent.pipe = gpipe.pipeline(model, ["blocks.2"], idx_of(2))
    keys = list(parent.state_dict())
    assert keys == ["pipe." + k for k in model.state_dict()]
    fresh = gpt()
    parent.load_state_dict({"pipe." + k: v for k, v in fresh.state_dict().items()})
    assert torch.equal(model.blocks[0].attn.qkv.weight, fresh.blocks[0].attn.qkv.weight)


def test_stages_balanced_by_parameter_count() -> None:
    model = GPT(n_layer=6).double()
    plain = twin(model)
    pipe = gpipe.pipeline(model, example_args=idx_of(2), stages=3, chunks=2)
    assert len(pipe) == 3
    # tok (tied with lm_head, counted once) and pos, then six equal blocks, ln_f, lm_head (0)
    firsts = [next(n.target for n in st.graph.nodes if n.op == "call_module") for st in pipe]
    assert firsts == ["tok", "blocks.2", "blocks.4"]
    assert pipe.split_points == ["blocks.2", "blocks.4"] and pipe.tracer == "fx"
    idx = idx_of(5)
    assert max_diff(pipe(idx), plain(idx)) < TOL
    with pytest.raises(ValueError, match="calls only"):
        gpipe.pipeline(gpt(), example_args=idx_of(2), stages=20)
    # One stage: no split point at all.
    for one in (gpipe.pipeline(model, example_args=idx_of(2), stages=1),
                gpipe.pipeline(model, [], idx_of(2))):
        assert len(one) == 1 and max_diff(one(idx), plain(idx)) < TOL


class Sleeper(nn.Module):
    """Equal parameters, unequal time: only profiling tells them apart."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.ms / 1000)
        return x * self.scale


class Sleepers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.ModuleList(Sleeper(ms) for ms in (1, 1, 1, 30))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.s:
            x = torch.tanh(layer(x))
        return x


def test_stages_balanced_by_profiled_time() -> None:
    model = Sleepers()
    x = torch.randn(3, 4, dtype=torch.float64)
    rng = torch.get_rng_state()
    by_params = gpipe.pipeline(model, example_args=x, stages=2)
    by_time = gpipe.pipeline(model, example_args=x, stages=2, balance_by="time")
    firsts = [[next(n.target for n in st.graph.nodes if n.op == "call_module") for st in pipe]
              for pipe in (by_params, by_time)]
    assert firsts == [["s.0", "s.2"], ["s.0", "s.3"]]
    # Profiling left the module as it was: no grads, the same values, the RNG untouched.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, torch.ones(4, dtype=torch.float64)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert max_diff(by_time(x), model(x)) < TOL
    with pytest.raises(ValueError, match="balance_by must be 'params' or 'time'"):
        gpipe.pipeline(model, example_args=x, stages=2, balance_by="size")


class Body(nn.Module):
    """The blocks inside a submodule, as Hugging Face writes a causal LM: model.layers."""

    def __init__(self, n_layer: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.layers = nn.ModuleList(Block() for _ in range(n_layer))
        self.norm = nn.LayerNorm(C)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        mask = torch.ones(t, t, device=idx.device).tril()
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.model.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.lm_head(self.model(idx))


def test_stages_split_inside_a_submodules_module_list() -> None:
    # Issue 45: stages=K looks into model.layers (today it saw only 'model' and 'lm_head').
    model = CausalLM().double()
    plain = twin(model)
    pipe = gpipe.pipeline(model, example_args=idx_of(2), stages=3, chunks=2)
    assert pipe.tracer == "fx"
    # model.tok (tied with lm_head, counted once), then six equal blocks, norm, lm_head (0).
    assert pipe.split_points == ["model.layers.2", "model.layers.4"]
    assert list(pipe.state_dict()) == list(model.state_dict())
    idx = idx_of(5)
    outputs_and_grads_equal(pipe(idx), plain(idx), model, plain)
    # Within a list only its items are split at: a block's own Sequential (mlp) is not.
    with pytest.raises(ValueError, match=r"calls only 9 submodules.*'model.layers.5', "
                                         r"'model.norm', 'lm_head'\]"):
        gpipe.pipeline(model, example_args=idx_of(2), stages=10)


class Gated(nn.Module):
    """A ModuleList inside a forward that branches on a value: no tracer enters it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        if x.sum() > 0:
            x = -x
        return x


class AroundGated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.body, self.out = nn.Linear(4, 4), Gated(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.body(self.inp(x)))


def test_stages_fall_back_to_the_submodules_the_root_calls() -> None:
    # stages=2 by parameters would begin at body.layers.2, inside a forward neither tracer
    # follows; the split then falls back to the root's own calls (body stays untraced).
    model = AroundGated().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    pipe = gpipe.pipeline(model, example_args=x, stages=2, chunks=1)
    assert pipe.tracer == "fx" and pipe.split_points in (["body"], ["out"]), pipe.split_points
    assert max_diff(pipe(x), model(x)) < TOL
    with pytest.raises(RuntimeError, match="torch.fx nor with torch.export"):
        gpipe.pipeline(model, ["body.layers.2"], x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Sleepers()

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def test_stages_by_time_inside_a_submodule() -> None:
    model = Outer()
    x = torch.randn(3, 4, dtype=torch.float64)
    pipe = gpipe.pipeline(model, example_args=x, stages=2, balance_by="time")
    assert pipe.split_points == ["body.s.3"]
    assert max_diff(pipe(x), model(x)) < TOL


def test_split_point_inside_a_block() -> None:
    model = gpt()
    plain = twin(model)
    mask = causal()
    pipe = gpipe.pipeline(model, ["blocks.1.mlp", "blocks.2.attn"], idx_of(2),
                          {"attention_mask": mask}, chunks=3, batch_dim=[0, None])
    idx = idx_of(5)
    out = pipe(idx, attention_mask=mask)
    ref = plain(idx, attention_mask=mask)
    outputs_and_grads_equal(out, ref, model, plain)
    assert list(pipe.state_dict()) == list(model.state_dict())


class TupleAcross(nn.Module):
    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.pair, self.mid, self.whole = Pair(), nn.Linear(3, 3), whole

    def forward(self, x: Tensor) -> tuple:
        p = self.pair(x)
        h = self.mid(p[0])
        if self.whole:  # a Python attribute, not a traced value
            return (h + torch.stack(p).sum(0),)
        return h, p[1]


def test_tuple_output_and_a_tuple_crossing_whole_is_refused() -> None:
    model = TupleAcross(whole=False).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    out = gpipe.pipeline(model, ["mid"], x, chunks=2)(x)
    ref = model(x)
    assert isinstance(out, tuple) and len(out) == 2
    assert max_diff(out[0], ref[0]) < TOL and max_diff(out[1], ref[1]) < TOL
    with pytest.raises(RuntimeError, match="only tensors cross stages"):
        gpipe.pipeline(TupleAcross(whole=True).double(), ["mid"], x)


class EarlyRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = x * self.head.weight.norm()  # a read of the split point's weight, not its call
        return self.head(self.body(x).relu())


def test_a_parameter_read_does_not_begin_the_stage() -> None:
    model = EarlyRead().double()
    plain = twin(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["head"], x, chunks=2)
    assert "body" in dict(pipe[0].named_children()) and "body" not in dict(pipe[1].named_children())
    assert pipe[0].head.weight is pipe[1].head.weight is model.head.weight
    out, ref = pipe(x), plain(x)
    assert max_diff(out, ref) < TOL
    out.sum().backward()
    ref.sum().backward()
    grads_equal(model, plain)
    assert list(pipe.state_dict()) == list(model.state_dict())


class Reused(nn.Module):
    """One submodule called in two stages (shared weights, ALBERT-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.mid = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.mid(self.block(x).tanh())
        h += x  # x carried from stage 0's input
        return self.block(h)


def test_a_submodule_called_in_two_stages_per_stage_checkpoint() -> None:
    model = Reused().double()
    plain = twin(model)
    x = torch.randn(5, 3, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["mid"], x, chunks=3, checkpoint=["always", "never"],
                          devices=["cpu", "cpu"])
    assert pipe[0].block is pipe[1].block is model.block
    assert len(list(pipe.parameters())) == 4
    out, ref = pipe(x), plain(x)
    assert max_diff(out, ref) < TOL
    out.sum().backward()
    ref.sum().backward()
    grads_equal(model, plain)
    assert list(pipe.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_v"])
def test_four_stages_on_two_workers(schedule: str) -> None:
    # zb_v: worker 0 runs stage 0 (the embeddings) and stage 3 (the tied head) in its V.
    model = gpt()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.2", "blocks.3"], idx_of(2), chunks=4,
                          schedule=schedule, virtual_stages=2, devices=["cpu", "cpu"])
    train_step_equals_plain(pipe, model, plain, (idx_of(6),), idx_of(6), lm_loss)


class WithLoss(GPT):
    def forward(self, idx: Tensor, targets: Tensor) -> tuple:  # type: ignore[override]
        logits = GPT.forward(self, idx)
        return logits, lm_loss(logits, targets)


def test_a_loss_inside_forward_is_refused_by_the_pipe() -> None:
    idx, target = idx_of(4), idx_of(4)
    pipe = gpipe.pipeline(WithLoss().double(), ["blocks.2"], (idx, target), chunks=2)
    with pytest.raises(ValueError, match="0-dimensional"):
        pipe(idx, target)


# tracer="export": torch.export with a dynamic batch Dim instead of torch.fx.

@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("with_mask", [False, True])
def test_export_gpt_outputs_grads_state_dict_tie(checkpoint: str, chunks: int,
                                                 with_mask: bool) -> None:
    model = gpt()
    plain = twin(model)
    mask = causal()
    kwargs = {"attention_mask": mask} if with_mask else {}
    pipe = gpipe.pipeline(model, ["blocks.1", "blocks.3"], (idx_of(2),), kwargs,
                          tracer="export", chunks=chunks, checkpoint=checkpoint,
                          batch_dim={"attention_mask": None} if with_mask else 0)
    assert len(pipe) == 3
    assert pipe[0].tok.weight is pipe[2].lm_head.weight is model.tok.weight
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    # Each stage holds only the parameters it uses (export reads them all up front; it reads
    # the tied embedding as "lm_head.weight").
    assert not [k for k in pipe[0].state_dict()
                if not k.startswith(("tok.", "pos.", "blocks.0.", "lm_head.weight"))]
    assert sorted({k.split(".")[0] for k in pipe[2].state_dict()}) == ["blocks", "lm_head", "ln_f"]
    assert list(pipe.state_dict()) == list(model.state_dict())
    for rows in (7, 1):  # uneven micro-batches; one row
        idx = idx_of(rows)
        out, ref = pipe(idx, **kwargs), plain(idx, **kwargs)
        outputs_and_grads_equal(out, ref, model, plain)


def test_export_unet_and_train_step() -> None:
    model = UNet().double()
    plain = twin(model)
    x, y = torch.randn(5, 2, 8, dtype=torch.float64), torch.randn(5, 2, 8, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["enc2", "mid", "dec1"], torch.randn(2, 2, 8).double(),
                          tracer="export", chunks=3)
    assert max_diff(pipe(x), plain(x)) < TOL
    train_step_equals_plain(pipe, model, plain, (x,), y, F.mse_loss)


def test_export_untraceable_names_the_line() -> None:
    with pytest.raises(RuntimeError) as info:
        gpipe.pipeline(DataDependent(), ["b"], torch.randn(2, 3), tracer="export")
    text = str(info.value)
    assert "if h.sum() > 0:" in text and "DataDependent.forward" in text
    assert "nn.Sequential" in text and "tracer='fx'" in text


# nanoGPT's model (Karpathy's model.py, trimmed: no init, no generate), compiled from this
# string so that pytest does not rewrite its assert: written the usual way, with a ModuleDict,
# a causal-mask buffer, dropout, an assert on a traced size and (logits, None) returned.
_NANOGPT = '''
import math
import torch
import torch.nn as nn
from torch.nn import functional as F

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                                        .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class NanoGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        else:
            logits = self.lm_head(x)
            loss = None
        return logits, loss
'''


def nanogpt() -> nn.Module:
    scope: dict = {}
    exec(compile(_NANOGPT, "nanogpt_model.py", "exec"), scope)
    return scope["NanoGPT"](V, T, 4, H, C).double()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_nanogpt(tracer: str) -> None:
    model = nanogpt()
    plain = twin(model)
    pipe = gpipe.pipeline(model, ["transformer.h.1", "transformer.h.3"], idx_of(2),
                          tracer=tracer, chunks=4)
    assert pipe[0].transformer.wte.weight is pipe[2].lm_head.weight is model.lm_head.weight
    assert list(pipe.state_dict()) == list(model.state_dict())
    idx = idx_of(7)
    (logits, loss), (ref, ref_loss) = pipe(idx), plain(idx)
    assert loss is None and ref_loss is None
    assert max_diff(logits, ref) < TOL
    w = torch.randn_like(logits)
    (logits * w).sum().backward()
    (ref * w).sum().backward()
    grads_equal(model, plain)
    if tracer == "fx":  # the assert is traced; export checks sizes against its own guards
        with pytest.raises(AssertionError, match="nanogpt_model.py:70"):
            pipe(torch.randint(0, V, (2, T + 1)))


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.c = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(self.a(x))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_batchnorm_running_statistics_one_chunk(tracer: str) -> None:
    # One micro-batch: BatchNorm sees the whole batch, as in the plain model (with more,
    # each micro-batch is normalised by its own statistics, as in any Pipe).
    model = WithBatchNorm().double()
    plain = twin(model)
    x = torch.randn(8, 3, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["c"], x, tracer=tracer, chunks=1)
    assert int(model.a[1].num_batches_tracked) == 0  # building ran the example, then restored
    assert max_diff(pipe(x), plain(x)) < TOL
    assert max_diff(model.a[1].running_mean, plain.a[1].running_mean) < TOL
    assert max_diff(model.a[1].running_var, plain.a[1].running_var) < TOL
    assert int(model.a[1].num_batches_tracked) == 1


def test_export_keeps_its_mode_and_refuses_another() -> None:
    # An exported graph keeps the training mode it was exported in: a call in the other mode
    # would silently run the wrong BatchNorm, so it is refused; fx follows the mode.
    model = WithBatchNorm().double().eval()
    x = torch.randn(8, 3, dtype=torch.float64)
    pipe = gpipe.pipeline(model, ["c"], x, tracer="export").eval()
    assert max_diff(pipe(x), model(x)) < TOL
    pipe.train()
    with pytest.raises(RuntimeError, match=r"in eval mode.*call pipe.eval\(\)"):
        pipe(x)
    with pytest.raises(RuntimeError, match="in eval mode"):
        pipe.train_step(x, torch.zeros(8, 2, dtype=torch.float64), F.mse_loss)
    fx_pipe = gpipe.pipeline(model, ["c"], x).train()
    model.train()
    plain = twin(model)
    assert max_diff(fx_pipe(x), plain(x)) < TOL
    with pytest.raises(ValueError, match="deferred_batch_norm=True.*tracer='fx'"):
        gpipe.pipeline(model, ["c"], x, tracer="export", deferred_batch_norm=True)
    # Pickling would trace the stages' code again and lose parameters: refused, naming the way.
    with pytest.raises(TypeError, match=r"pipe.tracer == 'export'.* cannot be pickled"):
        pickle.dumps(pipe)
    copied = copy.deepcopy(pipe.eval())
    assert list(copied.state_dict()) == list(model.state_dict())
    assert max_diff(copied(x), model.eval()(x)) < TOL
