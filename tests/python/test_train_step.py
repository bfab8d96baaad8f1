"""train_step: the step run inside the pipeline equals loss_fn(model(x), y).backward() (1e-10)."""
import copy
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gpipe
from conftest import (MODES, TOL, MyError, RaiseInBackward, TensorOrTensors, as_tuple,
                      assert_close, assert_same_grads, leaf_copy, max_diff, mlp, notes,
                      raises_within_timeout, result)

f64 = torch.float64

# Every schedule as (name, virtual_stages). interleaved_1f1b with v=1 is 1F1B's order
# built by the interleaved planner; v=2 and v=3 put several stages on each worker.
SCHEDULES = {
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "zb_h1": ("zb_h1", 1),
    "interleaved-v1": ("interleaved_1f1b", 1),
    "interleaved-v2": ("interleaved_1f1b", 2),
    "interleaved-v3": ("interleaved_1f1b", 3),
    # Two stages per worker in a V: worker 0 runs stages 0 and 3, worker 1 stages 1 and 2.
    "zb_v": ("zb_v", 2),
}

# Balances of mlp()'s 7 layers, 3 or 4 stages (v=2: 4 stages on 2 workers, v=3: 6 on 2).
# [1, 4, 2], [1, 2, 2, 2] and [2, 1, 1, 1, 1, 1]: an in-place ReLU opens a stage.
MLP_BALANCE = {
    "gpipe": [3, 2, 2],
    "1f1b": [1, 4, 2],
    "zb_h1": [1, 2, 2, 2],
    "interleaved-v1": [2, 3, 2],
    "interleaved-v2": [1, 2, 2, 2],
    "interleaved-v3": [2, 1, 1, 1, 1, 1],
    "zb_v": [2, 1, 2, 2],
}

# Balances of the 6-layer models below (tuple_model, dropout_model, failing_model).
SIX_BALANCE = {
    "gpipe": [2, 2, 2],
    "1f1b": [1, 2, 3],
    "zb_h1": [1, 1, 2, 2],
    "interleaved-v1": [1, 3, 2],
    "interleaved-v2": [1, 1, 2, 2],
    "interleaved-v3": [1, 1, 1, 1, 1, 1],
    "zb_v": [2, 1, 1, 2],
}

# (rows, chunks): 8 in 4; 7 in 3 (3, 2, 2); 6 in 2, fewer micro-batches than stages;
# one micro-batch; 5 chunks of 3 rows (three one-row micro-batches).
CHUNKINGS = {
    "even": (8, 4),
    "uneven": (7, 3),
    "fewer-than-stages": (6, 2),
    "one": (5, 1),
    "more-chunks-than-rows": (3, 5),
}


def pipe_options(config: str, balances: Dict[str, List[int]]) -> Dict[str, Any]:
    schedule, virtual = SCHEDULES[config]
    return dict(balance=balances[config], schedule=schedule, virtual_stages=virtual,
                devices="cpu")


def stage_of(layer: int, balance: List[int]) -> int:
    """The stage holding layer ``layer`` under ``balance``."""
    bounds = list(itertools.accumulate(balance))
    return next(s for s, end in enumerate(bounds) if layer < end)


def compare_train_step(model: nn.Sequential, x: TensorOrTensors, y: TensorOrTensors,
                       loss_fn: Callable[..., Tensor],
                       **pipe_kwargs: Any) -> Tuple[gpipe.Pipe, nn.Sequential]:
    """One train_step of a Pipe over ``model`` against loss_fn(plain(x), y).backward() on a
    deepcopy: the loss, every parameter grad and the input grads agree."""
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, **pipe_kwargs)
    x_ref, x_pipe = leaf_copy(x), leaf_copy(x)
    want = loss_fn(ref(x_ref), y)
    want.backward()
    got = result(lambda: pipe.train_step(x_pipe, y, loss_fn))
    assert isinstance(got, Tensor) and not got.requires_grad, "the returned loss is not detached"
    assert_close(got, want.detach(), what="loss")
    for k, (a, b) in enumerate(zip(as_tuple(x_pipe), as_tuple(x_ref))):
        if b.requires_grad:
            assert_close(a.grad, b.grad, what=f"input grad {k}")
        else:
            assert a.grad is None, f"input {k} does not require grad but got one"
    assert_same_grads(pipe, ref)
    return pipe, ref


# -- models ------------------------------------------------------------------------------------

class Merge(nn.Module):
    """(a, b) -> tensor: a tuple input taken as one argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tensor:
        a, b = inputs
        return torch.tanh(self.a(a)) * self.b(b)


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.lin(x), torch.sin(x)


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, g = inputs
        return torch.tanh(self.lin(h) + g), h * g


def tuple_model() -> nn.Sequential:
    """Tuple in, tuples between stages, tuple out; 6 layers."""
    return nn.Sequential(Merge(), Split(), Mix(), Mix(), Mix(), Mix()).double()


def tuple_input(rows: int) -> Tuple[Tensor, Tensor]:
    return (torch.randn(rows, 4, dtype=f64, requires_grad=True),
            torch.randn(rows, 3, dtype=f64, requires_grad=True))


def tuple_target(rows: int) -> Tuple[Tensor, Tensor]:
    return torch.randn(rows, 6, dtype=f64), torch.randn(rows, 6, dtype=f64)


def tuple_loss(out: Tuple[Tensor, Tensor], target: Tuple[Tensor, Tensor]) -> Tensor:
    """Both outputs against both targets, each mean-reduced."""
    return F.mse_loss(out[0], target[0]) + 0.5 * F.smooth_l1_loss(out[1], target[1])


def mlp_data(rows: int, requires_grad: bool = True) -> Tuple[Tensor, Tensor]:
    return (torch.randn(rows, 5, dtype=f64, requires_grad=requires_grad),
            torch.randn(rows, 3, dtype=f64))


# -- 1. transparency ---------------------------------------------------------------------------

@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("config", list(SCHEDULES))
def test_transparency_tensor(config, checkpoint, chunking):
    rows, chunks = CHUNKINGS[chunking]
    x, y = mlp_data(rows)
    compare_train_step(mlp(), x, y, F.mse_loss, chunks=chunks, checkpoint=checkpoint,
                       **pipe_options(config, MLP_BALANCE))


@pytest.mark.parametrize("chunking", ["uneven", "fewer-than-stages", "more-chunks-than-rows"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("config", list(SCHEDULES))
def test_transparency_tuples(config, checkpoint, chunking):
    rows, chunks = CHUNKINGS[chunking]
    compare_train_step(tuple_model(), tuple_input(rows), tuple_target(rows), tuple_loss,
                       chunks=chunks, checkpoint=checkpoint, **pipe_options(config, SIX_BALANCE))


@pytest.mark.parametrize("config", list(SCHEDULES))
def test_input_grad_only_where_required(config):
    """An input without grad gets none (stage 0 then passes no grad back); in a tuple,
    only the element that requires one gets it."""
    x, y = mlp_data(7, requires_grad=False)
    compare_train_step(mlp(), x, y, F.mse_loss, chunks=3, checkpoint="except_last",
                       **pipe_options(config, MLP_BALANCE))
    a, b = tuple_input(7)
    compare_train_step(tuple_model(), (a, b.detach()), tuple_target(7), tuple_loss, chunks=3,
                       checkpoint="except_last", **pipe_options(config, SIX_BALANCE))


@pytest.mark.parametrize("config", ["1f1b", "zb_h1"])
def test_loss_fn_with_a_parameter_of_its_own(config):
    """What loss_fn itself uses (here a parameter) gets its grad too."""
    scale = nn.Parameter(torch.tensor(1.5, dtype=f64))
    ref_scale = nn.Parameter(scale.detach().clone())
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=3, checkpoint="always", **pipe_options(config, MLP_BALANCE))
    x, y = mlp_data(7)
    got = result(lambda: pipe.train_step(x, y, lambda o, t: F.mse_loss(o * scale, t)))
    want = F.mse_loss(ref(x) * ref_scale, y)
    want.backward()
    assert_close(got, want.detach(), what="loss")
    assert_close(scale.grad, ref_scale.grad, what="loss_fn's parameter grad")
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("config", ["gpipe", "1f1b", "zb_h1", "interleaved-v2"])
def test_integer_targets_with_cross_entropy(config):
    x, _ = mlp_data(10)
    y = torch.randint(0, 3, (10,))
    compare_train_step(mlp(), x, y, F.cross_entropy, chunks=4, checkpoint="except_last",
                       **pipe_options(config, MLP_BALANCE))


class SeqLinear(nn.Module):
    """[seq, batch, features] in and out."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) + x.mean(0, keepdim=True)[..., :1]


@pytest.mark.parametrize("config", ["1f1b", "zb_h1"])
def test_batch_dim_1_input_with_a_target_cut_along_dim_0(config):
    """A sequence-first input is cut along batch_dim=1, the target along dim 0 (its rows
    are the batch): loss_fn gets matching pieces."""
    model = nn.Sequential(SeqLinear(4, 4), SeqLinear(4, 4), SeqLinear(4, 2)).double()
    x = torch.randn(5, 7, 4, dtype=f64, requires_grad=True)  # seq 5, batch 7
    y = torch.randn(7, 5, 2, dtype=f64)                      # batch first

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(out.transpose(0, 1), target)

    compare_train_step(model, x, y, loss_fn, balance=[1, 1, 1], devices="cpu", chunks=3,
                       batch_dim=1, schedule=SCHEDULES[config][0])


@pytest.mark.parametrize("config", ["1f1b", "zb_h1"])
def test_eval_mode_step_equals_plain_eval(config):
    """pipe.eval(): dropout is off and nothing is checkpointed (no recompute); the step
    still fills the grads."""
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8),
                          nn.Dropout(0.5), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model).eval()
    pipe = gpipe.Pipe(model, chunks=3, checkpoint="always",
                      **pipe_options(config, SIX_BALANCE)).eval()
    x, y = mlp_data(7)
    x_pipe = leaf_copy(x)
    with gpipe.tracing(pipe) as trace:
        got = result(lambda: pipe.train_step(x_pipe, y, F.mse_loss))
    want = F.mse_loss(ref(x), y)
    want.backward()
    assert_close(got, want.detach(), what="loss")
    assert_close(x_pipe.grad, x.grad, what="input grad")
    assert_same_grads(pipe, ref)
    assert "recompute" not in {e.phase for e in trace.events}


# -- 2. accumulation and an optimizer loop -----------------------------------------------------

@pytest.mark.parametrize("config", list(SCHEDULES))
def test_two_steps_accumulate_like_two_backwards(config):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=3, checkpoint="except_last",
                      **pipe_options(config, MLP_BALANCE))
    for rows in (7, 5):
        x, y = mlp_data(rows)
        x_pipe = leaf_copy(x)
        result(lambda: pipe.train_step(x_pipe, y, F.mse_loss))
        F.mse_loss(ref(x), y).backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("config", list(SCHEDULES))
def test_sgd_loop_equals_plain(config):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="except_last",
                      **pipe_options(config, MLP_BALANCE))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in ref.parameters()]
    for _ in range(4):
        x, y = mlp_data(9, requires_grad=False)
        opt.zero_grad()
        got = result(lambda: pipe.train_step(x, y, F.mse_loss))
        opt.step()
        ref_opt.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        assert_close(got, want.detach(), what="loss")
    moved = max(max_diff(p, b) for p, b in zip(ref.parameters(), before))
    assert moved > 1e-3, "the optimizer did not move the parameters: the check is vacuous"
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert max_diff(p, q) <= TOL, f"{name} differs after the loop"


# -- 3. dropout under recompute ----------------------------------------------------------------

class Tag(nn.Module):
    """(x, row ids) -> (h, row ids): the ids travel with the rows so a layer knows which rows
    of the mini-batch a micro-batch holds, whatever order the schedule runs them in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 8)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        x, ids = inputs
        return torch.tanh(self.lin(x)), ids


class TaggedLinear(nn.Module):
    def __init__(self, out: int = 8, last: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, out)
        self.last = last

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Any:
        h, ids = inputs
        h = self.lin(h)
        return h if self.last else (torch.tanh(h), ids)


class RandDropout(nn.Module):
    """Dropout drawing its mask with torch.rand, recording (recomputing, row ids, mask) on
    every call; with ``replay`` set (one mask row per mini-batch row) it uses those masks."""

    def __init__(self, p: float = 0.4) -> None:
        super().__init__()
        self.p = p
        self.records: List[Tuple[bool, Tensor, Tensor]] = []
        self.replay: Optional[Tensor] = None

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, ids = inputs
        if self.replay is not None:
            mask = self.replay[ids]
        else:
            mask = (torch.rand(h.shape, dtype=h.dtype, device=h.device) >= self.p).to(h.dtype)
            self.records.append((gpipe.is_recomputing(), ids.clone(), mask.clone()))
        return h * mask / (1 - self.p), ids


def dropout_model() -> nn.Sequential:
    """6 layers; the dropouts are layers 1 and 3."""
    return nn.Sequential(Tag(), RandDropout(), TaggedLinear(), RandDropout(), TaggedLinear(),
                         TaggedLinear(3, last=True)).double()


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("config", list(SCHEDULES))
def test_dropout_recompute_sees_the_forward_masks_and_grads_match_them(config, checkpoint):
    """Runs can't be compared across checkpoint modes (the RNG is drawn in another order),
    so this checks what must hold within one run: each checkpointed micro-batch's recompute
    draws exactly the masks its forward drew, and the grads equal the plain model's
    replaying the masks the Pipe drew."""
    rows, chunks = 7, 3
    model = dropout_model()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=chunks, checkpoint=checkpoint,
                      **pipe_options(config, SIX_BALANCE))
    x, y = mlp_data(rows)
    ids = torch.arange(rows)
    x_pipe = leaf_copy(x)
    got = result(lambda: pipe.train_step((x_pipe, ids), y, F.mse_loss))

    recomputed = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    for k in (1, 3):
        records = pipe[k].records
        firsts = [(i, m) for again, i, m in records if not again]
        agains = [(i, m) for again, i, m in records if again]
        assert len(firsts) == chunks and len(agains) == recomputed, (
            f"layer {k}: {len(firsts)} forwards, {len(agains)} recomputes")
        full = torch.full((rows, 8), -1.0, dtype=f64)
        for i, m in firsts:
            full[i] = m
        assert sorted(torch.cat([i for i, _ in firsts]).tolist()) == list(range(rows))
        assert 0 < full.mean().item() < 1, "the masks drop nothing or everything"
        for i, m in agains:
            assert torch.equal(m, full[i]), f"layer {k}: the recompute drew other masks"
        ref[k].replay = full

    want = F.mse_loss(ref((x, ids)), y)
    want.backward()
    assert_close(got, want.detach(), what="loss")
    assert_close(x_pipe.grad, x.grad, what="input grad")
    assert_same_grads(pipe, ref)


# -- 4. frozen layers --------------------------------------------------------------------------

@pytest.mark.parametrize("frozen", [(0, 2), (4,), (6,)], ids=["first-layers", "middle", "last"])
@pytest.mark.parametrize("config", list(SCHEDULES))
def test_frozen_layers_get_no_grad(config, frozen):
    model = mlp()
    for k in frozen:
        model[k].requires_grad_(False)
    # With the first layers frozen and an input without grad, stage 0 needs no backward
    # at all under some balances.
    x, y = mlp_data(7, requires_grad=frozen != (0, 2))
    pipe, ref = compare_train_step(model, x, y, F.mse_loss, chunks=3, checkpoint="except_last",
                                   **pipe_options(config, MLP_BALANCE))
    for k in frozen:
        assert all(p.grad is None for p in pipe[k].parameters()), f"frozen layer {k} got a grad"
    assert any(p.grad is not None for p in pipe.parameters())


# -- 5. failures -------------------------------------------------------------------------------

class _RaiseInGrad(torch.autograd.Function):
    """Identity whose backward raises ``owner.error`` when the forward said so and the owner
    is still armed."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, owner: "Fail", hit: bool) -> Tensor:  # type: ignore[override]
        ctx.owner, ctx.hit = owner, hit
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:  # type: ignore[override]
        if ctx.hit and ctx.owner.armed:
            raise ctx.owner.error
        return grad, None, None


class Fail(nn.Module):
    """x * w that raises ``error`` on micro-batch ``microbatch`` (None: every one) while
    armed: in forward, in the backward on the input path (x's grad), in the backward on
    the weight path only (w's grad: under zb_h1 that runs in W, never in I), or in every
    recompute.

    A micro-batch is known by the order of first forwards (recomputes are not counted):
    a stage runs its forwards in micro-batch order under every schedule."""

    def __init__(self, where: str, microbatch: Optional[int], error: BaseException) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.where, self.microbatch, self.error = where, microbatch, error
        self.armed, self.forwards = True, 0

    def forward(self, x: Tensor) -> Tensor:
        i = None
        if not gpipe.is_recomputing():
            i, self.forwards = self.forwards, self.forwards + 1
        hit = self.armed and (self.microbatch is None or i == self.microbatch)
        if hit and self.where == "forward":
            raise self.error
        if self.armed and self.where == "recompute" and gpipe.is_recomputing():
            raise self.error
        x = _RaiseInGrad.apply(x, self, hit and self.where == "input")
        w = _RaiseInGrad.apply(self.w, self, hit and self.where == "weight")
        return torch.tanh(x * w)


def failing_model(fail: nn.Module, at: int = 3) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Linear(3, 3) for _ in range(5)]
    layers.insert(at, fail)
    return nn.Sequential(*layers).double()


def fail_and_recover(pipe: gpipe.Pipe, ref: nn.Sequential, x: Tensor, y: Tensor,
                     loss_fn: Callable[..., Tensor] = F.mse_loss) -> BaseException:
    """The exception of a failing train_step; then, disarmed, the same Pipe's next step
    equals the plain model's."""
    x_pipe = leaf_copy(x)
    raised = raises_within_timeout(lambda: pipe.train_step(x_pipe, y, loss_fn))
    for m in list(pipe) + list(ref):
        if hasattr(m, "armed"):
            m.armed = False
    pipe.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    x_pipe, x_ref = leaf_copy(x), leaf_copy(x)
    got = result(lambda: pipe.train_step(x_pipe, y, F.mse_loss))
    want = F.mse_loss(ref(x_ref), y)
    want.backward()
    assert_close(got, want.detach(), what="loss after the failure")
    assert_close(x_pipe.grad, x_ref.grad, what="input grad after the failure")
    assert_same_grads(pipe, ref)
    return raised


def failure_data() -> Tuple[Tensor, Tensor]:
    return (torch.randn(8, 3, dtype=f64, requires_grad=True), torch.randn(8, 3, dtype=f64))


def assert_note(e: BaseException, stage: int, microbatch: Optional[int], phase: str) -> None:
    text = notes(e)
    where = f"gpipe: raised in stage {stage}, micro-batch "
    assert where in text, f"expected {where!r}...; notes: {text!r}"
    if microbatch is not None:
        assert f"{where}{microbatch}, {phase}" in text, f"notes: {text!r}"
    else:
        assert text.endswith(f", {phase}"), f"notes: {text!r}"


@pytest.mark.parametrize("where", ["forward", "input"])
@pytest.mark.parametrize("config", list(SCHEDULES))
def test_layer_error_names_its_cell_and_the_next_step_works(config, where):
    err = MyError(f"boom in {where}")
    options = pipe_options(config, SIX_BALANCE)
    model = failing_model(Fail(where, 2, err))
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="never", **options)
    raised = fail_and_recover(pipe, ref, *failure_data())
    assert raised is err, repr(raised)
    stage = stage_of(3, options["balance"])
    if where == "forward":
        phase = "forward"
    else:  # the input path: zb_h1's I (stage 3 of the model is never stage 0 here)
        assert stage > 0
        phase = "input-grad backward" if config in ("zb_h1", "zb_v") else "backward"
    assert_note(raised, stage, 2, phase)


@pytest.mark.parametrize("config", list(SCHEDULES))
def test_backward_error_under_recompute(config):
    """Every micro-batch's backward raises (checkpointed: after a recompute)."""
    err = MyError("boom after recompute")
    options = pipe_options(config, SIX_BALANCE)
    model = failing_model(RaiseInBackward(err))
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="always", **options)
    raised = fail_and_recover(pipe, copy.deepcopy(model), *failure_data())
    assert raised is err, repr(raised)
    phase = "input-grad backward" if config in ("zb_h1", "zb_v") else "backward"
    assert_note(raised, stage_of(3, options["balance"]), None, phase)


@pytest.mark.parametrize("config", list(SCHEDULES))
def test_recompute_error_names_its_phase(config):
    err = MyError("boom in recompute")
    options = pipe_options(config, SIX_BALANCE)
    model = failing_model(Fail("recompute", None, err))
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="always", **options)
    raised = fail_and_recover(pipe, copy.deepcopy(model), *failure_data())
    assert raised is err, repr(raised)
    assert_note(raised, stage_of(3, options["balance"]), None, "recompute")


@pytest.mark.parametrize("at", [0, 3, 5], ids=["stage-0", "middle", "last-stage"])
@pytest.mark.parametrize("config", ["zb_h1", "zb_v", "1f1b", "gpipe"])
def test_weight_grad_error(config, at):
    """A failure only in a weight's grad: zb_h1's W ('weight-grad backward'; stage 0's too),
    the whole backward ('backward') under the others."""
    err = MyError("weight boom")
    options = pipe_options(config, SIX_BALANCE)
    model = failing_model(Fail("weight", 1, err), at=at)
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="never", **options)
    raised = fail_and_recover(pipe, copy.deepcopy(model), *failure_data())
    assert raised is err, repr(raised)
    phase = "weight-grad backward" if config in ("zb_h1", "zb_v") else "backward"
    assert_note(raised, stage_of(at, options["balance"]), 1, phase)


@pytest.mark.parametrize("error_type", [MyError, ValueError, KeyError])
@pytest.mark.parametrize("config", list(SCHEDULES))
def test_loss_fn_error_is_its_own_and_names_the_microbatch(config, error_type):
    err = error_type("loss boom")
    options = pipe_options(config, SIX_BALANCE)
    model = failing_model(nn.Identity())
    x, y = failure_data()
    k = 2
    target_k = torch.tensor_split(y, 4)[k]

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        if target.shape == target_k.shape and torch.equal(target, target_k):
            raise err
        return F.mse_loss(out, target)

    pipe = gpipe.Pipe(model, chunks=4, checkpoint="except_last", **options)
    raised = fail_and_recover(pipe, copy.deepcopy(model), x, y, loss_fn)
    assert raised is err, repr(raised)
    assert_note(raised, len(options["balance"]) - 1, k, "loss")


def test_failed_step_leaves_no_thread_busy():
    """Several failures in a row, then many good steps: nothing hangs or leaks a task."""
    err = MyError("again")
    fail = Fail("input", None, err)
    model = failing_model(fail)
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, chunks=4, checkpoint="except_last", **pipe_options("zb_h1",
                                                                                SIX_BALANCE))
    x, y = failure_data()
    for _ in range(3):
        assert raises_within_timeout(lambda: pipe.train_step(x, y, F.mse_loss)) is err
    fail_and_recover(pipe, ref, x, y)


# -- 6. bad arguments --------------------------------------------------------------------------

def small_pipe(**kwargs: Any) -> gpipe.Pipe:
    return gpipe.Pipe(mlp(), balance=[3, 2, 2], chunks=2, devices="cpu", **kwargs)


@pytest.mark.parametrize("loss_fn", [3, None, "mse"])
def test_loss_fn_not_callable(loss_fn):
    x, y = mlp_data(4)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        small_pipe().train_step(x, y, loss_fn)


def test_loss_fn_returning_a_non_tensor():
    x, y = mlp_data(4)
    raised = raises_within_timeout(lambda: small_pipe().train_step(x, y, lambda o, t: 1.0))
    assert isinstance(raised, TypeError) and "float" in str(raised), repr(raised)
    assert_note(raised, 2, 0, "loss")


def test_loss_fn_returning_a_non_scalar():
    x, y = mlp_data(4)
    raised = raises_within_timeout(lambda: small_pipe().train_step(x, y, lambda o, t: o - t))
    assert isinstance(raised, RuntimeError), repr(raised)
    assert "micro-batch 0" in str(raised) and "[2, 3]" in str(raised), str(raised)
    # The example is Python's, not C++'s.
    assert "torch.nn.functional.mse_loss(output, target)" in str(raised), str(raised)


def test_loss_that_does_not_require_grad():
    x, y = mlp_data(4)
    raised = raises_within_timeout(
        lambda: small_pipe().train_step(x, y, lambda o, t: F.mse_loss(o, t).detach()))
    assert isinstance(raised, RuntimeError) and "does not require grad" in str(raised), raised


@pytest.mark.parametrize("target_rows", [6, 9])
def test_target_with_wrong_rows(target_rows):
    x, _ = mlp_data(8)
    y = torch.randn(target_rows, 3, dtype=f64)
    pipe = small_pipe()
    with pytest.raises(ValueError) as excinfo:
        pipe.train_step(x, y, F.mse_loss)
    message = str(excinfo.value)
    assert f"target has {target_rows} rows" in message and "has 8" in message, message
    # Refused before anything ran: the next step works.
    x, y = mlp_data(8)
    result(lambda: pipe.train_step(x, y, F.mse_loss))


# A tuple target whose values have different row counts is refused naming the target (not
# "input", and not batch_dim, which does not apply to targets).
def test_ragged_tuple_target_is_named_as_the_target():
    x, y = mlp_data(8)
    pipe = small_pipe()
    with pytest.raises(ValueError) as excinfo:
        pipe.train_step(x, (y, y[:5]), lambda o, t: F.mse_loss(o, t[0]))
    message = str(excinfo.value)
    assert "target" in message and "5" in message and "8" in message, message
    assert "input 0" not in message and "batch_dim" not in message, message


@pytest.mark.parametrize("bad", [[torch.zeros(4, 3)], 3, None, ()],
                         ids=["list", "int", "None", "empty-tuple"])
def test_target_not_a_tensor(bad):
    x, _ = mlp_data(4)
    with pytest.raises(TypeError, match="target"):
        small_pipe().train_step(x, bad, F.mse_loss)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_virtual_stages_needs_interleaved(schedule):
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        gpipe.Pipe(mlp(), balance=[2, 2, 2, 1], schedule=schedule, virtual_stages=2)


@pytest.mark.parametrize("virtual", [0, -1])
def test_virtual_stages_must_be_positive(virtual):
    with pytest.raises(ValueError, match="virtual_stages"):
        gpipe.Pipe(mlp(), balance=[7], schedule="interleaved_1f1b", virtual_stages=virtual)


def test_balance_not_a_multiple_of_virtual_stages():
    with pytest.raises(ValueError, match=r"\[3, 2, 2\].*virtual_stages 2"):
        gpipe.Pipe(mlp(), balance=[3, 2, 2], schedule="interleaved_1f1b", virtual_stages=2)


def test_a_v_placement_with_more_devices_than_it_uses_is_refused():
    """zb_v runs two stages per device: 8 entries on 8 devices would leave 4 idle (issue 44)."""
    eight = lambda: nn.Sequential(*[nn.Linear(3, 3) for _ in range(8)])  # noqa: E731
    with pytest.raises(ValueError, match=r"zb_v.*uses 4 devices, but 8 devices.*16 entries"):
        gpipe.Pipe(eight(), balance=[1] * 8, devices=["cpu"] * 8, schedule="zb_v")
    with pytest.raises(ValueError, match=r"uses 1 device, but 2 devices"):
        gpipe.Pipe(eight(), balance=[4, 4], devices=["cpu", "cpu"], schedule="zb_v")
    with pytest.raises(ValueError, match=r"virtual_stages 2.*uses 2 devices, but 3 devices"):
        gpipe.Pipe(eight(), balance=[2, 2, 2, 2], devices=["cpu"] * 3,
                   schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match=r"8 devices need at least 16 layers.*pass 4 devices"):
        gpipe.Pipe(eight(), devices=["cpu"] * 8, schedule="zb_v")
    # What it uses, exactly: fine; one stage per device keeps torchgpipe's rule.
    assert len(gpipe.Pipe(eight(), balance=[1] * 8, devices=["cpu"] * 4,
                          schedule="zb_v").devices) == 4
    assert len(gpipe.Pipe(eight(), balance=[4, 4], devices=["cpu"] * 8).devices) == 2
    assert len(gpipe.Pipe(eight(), devices=["cpu"] * 4, schedule="zb_v").balance) == 8


@pytest.mark.parametrize("name", ["zb", "1F1B", "interleaved", ""])
def test_unknown_schedule(name):
    with pytest.raises(ValueError, match="schedule"):
        gpipe.Pipe(mlp(), balance=[3, 4], schedule=name)


def test_train_step_under_no_grad():
    pipe = small_pipe()
    x, y = mlp_data(4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="no_grad"):
            pipe.train_step(x, y, F.mse_loss)
    result(lambda: pipe.train_step(x, y, F.mse_loss))


def test_interleaved_stages_run_on_their_devices():
    pipe = gpipe.Pipe(mlp(), balance=[2, 1, 1, 1, 1, 1], devices=["cpu", "cpu"],
                      schedule="interleaved_1f1b", virtual_stages=3)
    assert len(pipe.devices) == 2 and "virtual_stages=3" in repr(pipe)


# -- 7. tracing --------------------------------------------------------------------------------

def traced_step(config: str, checkpoint: str, chunks: int = 4) -> Tuple[List[Any], int]:
    options = pipe_options(config, MLP_BALANCE)
    pipe = gpipe.Pipe(mlp(), chunks=chunks, checkpoint=checkpoint, **options)
    x, y = mlp_data(2 * chunks)
    with gpipe.tracing(pipe) as trace:
        result(lambda: pipe.train_step(x, y, F.mse_loss))
    return list(trace.events), len(options["balance"])


def cells(events: List[Any], phase: str, stage: int) -> List[int]:
    return sorted(e.microbatch for e in events if e.phase == phase and e.stage == stage)


@pytest.mark.parametrize("config", list(SCHEDULES))
def test_trace_has_a_loss_per_microbatch_and_every_cell(config):
    events, stages = traced_step(config, "always")
    m = 4
    assert cells(events, "loss", stages - 1) == list(range(m))
    assert all(e.stage == stages - 1 for e in events if e.phase == "loss")
    for s in range(stages):
        assert cells(events, "forward", s) == list(range(m)), f"stage {s}"
        assert cells(events, "recompute", s) == list(range(m)), f"stage {s}"
        if config in ("zb_h1", "zb_v"):
            assert cells(events, "backward", s) == []
            assert cells(events, "weight_grad", s) == list(range(m)), f"stage {s}"
            inputs = cells(events, "input_grad", s)
            # Stage 0 passes no grad back (the input needs one here, so it does run I);
            # every other stage runs one I per micro-batch.
            if s > 0:
                assert inputs == list(range(m)), f"stage {s}: {inputs}"
            else:
                assert set(inputs) <= set(range(m)) and len(set(inputs)) == len(inputs)
        else:
            assert cells(events, "backward", s) == list(range(m)), f"stage {s}"
            assert cells(events, "input_grad", s) == cells(events, "weight_grad", s) == []
    for e in events:
        if e.phase == "loss":
            forward = next(f for f in events if f.phase == "forward" and f.stage == e.stage
                           and f.microbatch == e.microbatch)
            assert forward.end_us <= e.start_us, "a loss ran before its forward ended"


def order_on_stage(events: List[Any], stage: int) -> List[str]:
    mine = sorted((e for e in events if e.stage == stage and e.phase != "copy"),
                  key=lambda e: e.start_us)
    return [e.phase for e in mine]


@pytest.mark.parametrize("config", ["1f1b", "zb_h1", "interleaved-v1"])
def test_one_f_one_b_interleaves_forwards_and_backwards(config):
    """With M=6 > K stages, worker 0 runs its first backward before its last forward."""
    events, stages = traced_step(config, "never", chunks=6)
    assert stages < 6
    order = order_on_stage(events, 0)
    backward = "backward" if config != "zb_h1" else "input_grad"
    first_b = order.index(backward) if backward in order else order.index("weight_grad")
    last_f = len(order) - 1 - order[::-1].index("forward")
    assert first_b < last_f, order


def test_gpipe_schedule_runs_every_forward_first():
    events, stages = traced_step("gpipe", "never", chunks=6)
    for s in range(stages):
        order = order_on_stage(events, s)
        last_f = len(order) - 1 - order[::-1].index("forward")
        assert last_f < order.index("backward"), (s, order)


# -- 8. deferred batch norm --------------------------------------------------------------------

def bn_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                         nn.BatchNorm1d(6), nn.Linear(6, 3)).double()


def batch_norms(module: nn.Module) -> List[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("config", ["gpipe", "1f1b", "zb_h1", "interleaved-v2"])
def test_deferred_batch_norm_as_forward_and_backward(config, checkpoint):
    """train_step's running statistics and grads equal those of forward + backward through an
    equal Pipe (each micro-batch normalised by its own statistics), and the first batch
    norm's statistics equal the plain model's (test_batchnorm.py's 1e-9: updated once per
    mini-batch, not per micro-batch or recompute)."""
    stats_tol = 1e-9
    seq = bn_model()
    plain = copy.deepcopy(seq)
    options = dict(chunks=4, checkpoint=checkpoint, deferred_batch_norm=True,
                   **pipe_options(config, SIX_BALANCE))
    stepped = gpipe.Pipe(copy.deepcopy(seq), **options)
    by_forward = gpipe.Pipe(seq, **options)
    for rows in (11, 8, 13):
        x = torch.randn(rows, 5, dtype=f64) * 3 + 2
        y = torch.randn(rows, 3, dtype=f64)
        stepped.zero_grad()
        by_forward.zero_grad()
        got = result(lambda: stepped.train_step(x, y, F.mse_loss))
        want = F.mse_loss(by_forward(x), y)
        result(lambda: want.backward())
        with torch.no_grad():
            plain(x)
        assert_close(got, want.detach(), what="loss")
        assert_same_grads(stepped, by_forward)
        for a, b, c in zip(batch_norms(stepped), batch_norms(by_forward), batch_norms(plain)):
            assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == int(
                c.num_batches_tracked)
            assert_close((a.running_mean, a.running_var), (b.running_mean, b.running_var),
                         what="running stats vs forward + backward")
        # Only the first batch norm sees the plain model's input: the second's follows
        # per-micro-batch normalisation, which the plain model does not do.
        first, first_plain = batch_norms(stepped)[0], batch_norms(plain)[0]
        assert_close((first.running_mean, first.running_var),
                     (first_plain.running_mean, first_plain.running_var), tol=stats_tol,
                     what="first running stats vs plain")
    assert max(b.running_mean.abs().max().item() for b in batch_norms(plain)) > 1e-2


def test_zb_v_runs_its_stages_in_a_v():
    # Worker 0 runs the first and the last stage (2W-1-w for w=0), worker 1 the turn of the V:
    # the exported table's rows say so, and every grad equals the plain model's.
    x, y = mlp_data(8)
    pipe, _ = compare_train_step(mlp(), x, y, F.mse_loss, chunks=4, **pipe_options("zb_v",
                                                                                 MLP_BALANCE))
    rows = [row.split(",") for row in pipe.schedule_csv().splitlines()]
    assert [sorted({int(a[0]) for a in row}) for row in rows] == [[0, 3], [1, 2]]
    assert {a[1] for row in rows for a in row} == {"F", "I", "W"}
    assert pipe.virtual_stages == 2 and "schedule='zb_v'" in repr(pipe)
    # virtual_stages may be left out (it is 2); any other count is refused.
    assert gpipe.Pipe(mlp(), balance=[2, 1, 2, 2], schedule="zb_v").virtual_stages == 2
    with pytest.raises(ValueError, match="'zb_v' runs two stages per device in a V"):
        gpipe.Pipe(mlp(), balance=[2, 1, 1, 1, 1, 1], schedule="zb_v", virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages 2"):
        gpipe.Pipe(mlp(), balance=[3, 2, 2], schedule="zb_v")


class DoubleGradOfInput(nn.Module):
    """Opens a stage: a hook on its input doubles the grad passing back through it, and the
    input keeps its grad (retain_grad), as on any non-leaf tensor of the plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad:
            x.register_hook(lambda g: g * 2)
            x.retain_grad()
            self.seen.append(x)
        return x


@pytest.mark.parametrize("config", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_hooks_on_a_stage_input_and_a_stage_passing_its_input_on(config, checkpoint):
    # A stage's input reaches its layers as a non-leaf alias whose grad ends in a node of the
    # cell's own: a tensor hook there changes the grad the previous stage gets, and a stage
    # made of one layer that returns its input passes the grad on unchanged, under every
    # schedule (zb_h1 and zb_v split that backward into I and W).
    def model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(4, 5), DoubleGradOfInput(), nn.Tanh(), nn.Identity(),
                             nn.Linear(5, 5), nn.ReLU(inplace=True), nn.Linear(5, 2)).double()
    balances = {name: [1, 2, 1, 3] for name in SCHEDULES}
    balances["gpipe"] = balances["1f1b"] = balances["interleaved-v1"] = [1, 3, 3]
    balances["interleaved-v3"] = [1, 2, 1, 1, 1, 1]
    x = torch.randn(6, 4, dtype=f64)
    y = torch.randn(6, 2, dtype=f64)
    pipe, ref = compare_train_step(model(), x, y, F.mse_loss, chunks=3, checkpoint=checkpoint,
                                   **pipe_options(config, balances))
    # The retained grads: the plain model's one for the batch, the Pipe's one per micro-batch
    # (checkpointed: on the recompute's aliases; the forward's graph was dropped unrun), in
    # whatever order the schedule ran the backwards.
    plain = list(ref[1].seen[-1].grad.tensor_split(3))
    got = [t.grad for t in pipe[1].seen if t.grad is not None]
    assert len(got) == 3, f"{len(got)} retained grads, want one per micro-batch"
    for g in got:
        match = [k for k, p in enumerate(plain) if max_diff(g, p) <= TOL]
        assert match, f"a retained grad matches no micro-batch of the plain model's: {g}"
        plain.pop(match[0])
