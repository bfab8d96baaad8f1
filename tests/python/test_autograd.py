"""test_autograd.py — the plain model's autograd semantics from Python: outside tensors, autograd.grad, backward(inputs=), hooks, in-place inputs, threads."""
import copy
import threading

import pytest
import torch
from torch import nn

import gpipe
from conftest import (MODES, TOL, Counter, assert_close, assert_same_grads, call_with_timeout,
                      max_diff, mlp)


class OutsideMatmul(nn.Module):
    """x @ w with a ``w`` the layer does not register (a closure over an outside tensor)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.get_w = lambda: w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.get_w()


class TiedLinear(nn.Module):
    """Uses another module's weight, transposed: a weight tied across stages."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.other = [other]  # a list: not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.other[0].weight


class Constant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(x.shape[0], 3, dtype=x.dtype)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("frozen", [False, True])
def test_outside_tensor_gets_the_plain_models_grad(checkpoint: str, frozen: bool) -> None:
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    model = nn.Sequential(nn.Linear(3, 3), OutsideMatmul(w), nn.Tanh(), OutsideMatmul(w)).double()
    if frozen:
        model.requires_grad_(False)
    ref = copy.deepcopy(model)  # the deep copy shares nothing, so rebuild its closures over w
    ref[1].get_w = lambda: w
    ref[3].get_w = lambda: w
    pipe = gpipe.Pipe(model, balance=[1, 2, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 3, dtype=torch.float64)

    want = ref(x)
    (want ** 2).sum().backward()
    want_w, w.grad = w.grad.clone(), None

    got = pipe(x)
    assert got.requires_grad == want.requires_grad
    assert_close(got, want, what="output")
    (got ** 2).sum().backward()
    assert w.grad is not None
    assert max_diff(w.grad, want_w) <= TOL
    if not frozen:
        assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", MODES)
def test_weight_tied_across_stages(checkpoint: str) -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        first = nn.Linear(4, 4)
        return nn.Sequential(first, nn.Tanh(), TiedLinear(first)).double()

    ref, model = build(), build()
    pipe = gpipe.Pipe(model, balance=[2, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    x = torch.randn(5, 4, dtype=torch.float64)
    (ref(x) ** 2).sum().backward()
    (pipe(x) ** 2).sum().backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", MODES)
def test_constant_output_does_not_require_grad(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), Constant()).double()
    pipe = gpipe.Pipe(model, balance=[1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    out = pipe(torch.randn(4, 3, dtype=torch.float64))
    assert not out.requires_grad
    assert out.grad_fn is None


@pytest.mark.parametrize("checkpoint", MODES)
def test_autograd_grad_on_input_leaves_parameters_alone(checkpoint: str) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    (got,) = torch.autograd.grad(pipe(x).sum(), x)
    (want,) = torch.autograd.grad(ref(x).sum(), x)
    assert max_diff(got, want) <= TOL
    assert all(p.grad is None for p in pipe.parameters())
    assert x.grad is None


@pytest.mark.parametrize("checkpoint", MODES)
def test_autograd_grad_on_parameters(checkpoint: str) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    x = torch.randn(6, 5, dtype=torch.float64)
    got = torch.autograd.grad(pipe(x).sum(), list(pipe.parameters()))
    want = torch.autograd.grad(ref(x).sum(), list(ref.parameters()))
    for g, w in zip(got, want):
        assert max_diff(g, w) <= TOL
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("checkpoint", MODES)
def test_backward_inputs_fills_only_those(checkpoint: str) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    pipe(x).sum().backward(inputs=[x, pipe[6].weight])
    ref(xr).sum().backward(inputs=[xr, ref[6].weight])
    assert max_diff(x.grad, xr.grad) <= TOL
    assert max_diff(pipe[6].weight.grad, ref[6].weight.grad) <= TOL
    for name, p in pipe.named_parameters():
        assert (p.grad is not None) == (name == "6.weight"), name


def test_parameter_hook_fires_once_with_the_whole_grad() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=4)
    seen = []
    pipe[0].weight.register_hook(lambda g: seen.append(g.clone()))
    x = torch.randn(8, 5, dtype=torch.float64)
    pipe(x).sum().backward()
    ref(x).sum().backward()
    assert len(seen) == 1
    assert max_diff(seen[0], ref[0].weight.grad) <= TOL


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_input_changed_in_place_raises_like_autograd(checkpoint: str, chunks: int) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    pipe = gpipe.Pipe(model, balance=[1, 2], devices=["cpu"] * 2, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(6, 3, dtype=torch.float64)
    loss = pipe(x).sum()
    x.add_(1.0)  # Linear saved x for its weight grad
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    pipe(torch.randn(6, 3, dtype=torch.float64)).sum().backward()  # the Pipe still works


class DropoutWhenSmall(nn.Module):
    """Dropout only on micro-batches of fewer than ``rows`` rows (the last, smaller one)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, self.training) if x.shape[0] < self.rows else x * 1.0


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_conditional_dropout_replays_exactly(checkpoint: str) -> None:
    model = nn.Sequential(nn.Identity(), DropoutWhenSmall(2), DropoutWhenSmall(2))
    pipe = gpipe.Pipe(model, balance=[2, 1], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    for _ in range(3):
        x = torch.ones(7, 64, dtype=torch.float64, requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        # out = x * masks / 0.25, and so is d out.sum() / dx if the replay drew the same masks.
        assert max_diff(x.grad, out.detach()) <= TOL
        assert bool((out[:6] == 1).all())


@pytest.mark.parametrize("grad", [False, True])
def test_one_pipe_from_several_threads(grad: bool) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=3)
    inputs = [torch.randn(6, 5, dtype=torch.float64) for _ in range(4)]
    worst = [0.0] * len(inputs)

    def work(t: int) -> None:
        with torch.set_grad_enabled(grad):
            for _ in range(10):
                out = pipe(inputs[t])
                if grad:
                    out.sum().backward()
                worst[t] = max(worst[t], max_diff(out, ref(inputs[t])))

    def all_threads() -> None:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(len(inputs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    outcome = call_with_timeout(all_threads)
    assert "error" not in outcome, outcome.get("error")
    assert max(worst) <= TOL


def test_pipe_inside_a_pipe_is_refused_at_once() -> None:
    inner = gpipe.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1],
                       devices=["cpu"] * 2, chunks=2)
    outer = gpipe.Pipe(nn.Sequential(nn.Linear(4, 4), inner), balance=[1, 1], devices=["cpu"] * 2,
                       chunks=2)
    x = torch.randn(4, 4)
    outcome = call_with_timeout(lambda: outer(x))
    assert "error" in outcome
    assert "inside a layer of a Pipe" in str(outcome["error"])
    inner(x).sum().backward()  # the inner Pipe still works on its own


@pytest.mark.parametrize("checkpoint", MODES)
def test_one_pipe_twice_in_one_graph(checkpoint: str) -> None:
    """Two outputs of the same Pipe in one loss: two PipeBackward nodes, run one after the other."""
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)
    x1 = torch.randn(4, 5, dtype=torch.float64)
    x2 = torch.randn(3, 5, dtype=torch.float64)
    outcome = call_with_timeout(lambda: (pipe(x1).sum() + pipe(x2).pow(2).sum()).backward())
    assert "error" not in outcome, outcome.get("error")
    (ref(x1).sum() + ref(x2).pow(2).sum()).backward()
    assert_same_grads(pipe, ref)


class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        raise AssertionError("this backward must not run: nothing asked for its grad")


class Unused(nn.Module):
    """Ignores its input's history (a detach): the output depends on no input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


@pytest.mark.parametrize("checkpoint", MODES)
def test_input_no_output_depends_on_runs_no_backward(checkpoint: str) -> None:
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    class Guarded(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return RaiseInBackward.apply(x @ w)

    model = nn.Sequential(Unused(), Guarded())
    pipe = gpipe.Pipe(model, balance=[1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    out = pipe(x)
    assert out.requires_grad  # through w
    out.sum().backward(inputs=[x])  # the plain model computes nothing here
    assert x.grad is None and w.grad is None
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(pipe(x).sum(), x)


class Spy(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        Spy.calls += 1
        return g


class SpyLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Spy.apply(x)


@pytest.mark.parametrize("checkpoint", MODES)
def test_parameter_no_output_depends_on_runs_no_backward(checkpoint: str) -> None:
    """Stage 0's weight is cut off by a constant stage: asking for its grad runs nothing."""
    model = nn.Sequential(nn.Linear(5, 3), Constant(), nn.Linear(3, 3), SpyLayer()).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 2, 1], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 5, dtype=torch.float64)
    for net in (ref, pipe):
        Spy.calls = 0
        net(x).sum().backward(inputs=[net[0].weight])
        assert net[0].weight.grad is None
        assert Spy.calls == 0, type(net).__name__


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.a(x), self.b(x)


class SecondOnly(nn.Module):
    def forward(self, xs):  # type: ignore[no-untyped-def]
        return xs[1] * 2


@pytest.mark.parametrize("checkpoint", MODES)
def test_value_the_next_stage_drops_gets_no_grad(checkpoint: str) -> None:
    """Stage 1 uses only the second of two values: the head making the first gets no grad
    (None, as in the plain model), not zeros made up at the stage boundary."""
    model = nn.Sequential(TwoHeads(), SecondOnly()).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    for net in (ref, pipe):
        net(x).sum().backward()
        assert net[0].a.weight.grad is None, type(net).__name__
        assert net[0].b.weight.grad is not None
    assert_same_grads(pipe, ref)


# -- found by the fuzzer (seed 8895) ----------------------------------------------------------

@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_backward_inputs_runs_no_node_the_plain_model_skips(checkpoint):
    """backward(inputs=[w]) for an outside tensor w runs only the nodes on paths to w, in the
    plain model; a layer's backward elsewhere (here a counting identity between the first
    Linear and the matmul with w) must not run, nor raise, nor fire hooks. The cell's small
    grads (w's, the Linear's weight's) share one capture node, and autograd marks nodes, not
    their inputs, as needed for a target: the backward ran the counting identity until the
    unwanted edges of a shared node were pointed elsewhere for the run."""
    torch.manual_seed(0)
    w = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    counter = Counter()
    model = nn.Sequential(nn.Linear(6, 3, bias=False), counter, OutsideMatmul(w)).double()
    pipe = gpipe.Pipe(model, balance=[3], chunks=1, checkpoint=checkpoint)
    x = torch.randn(2, 6, dtype=torch.float64)
    out = model(x)
    out.sum().backward(inputs=[w], retain_graph=True)
    assert counter.backwards == 0  # the plain model skips it
    want_w = w.grad
    out.sum().backward(inputs=[model[0].weight])  # then the rest of the graph
    want_weight = model[0].weight.grad
    w.grad, model[0].weight.grad = None, None
    counter.backwards = 0
    out = pipe(x)
    out.sum().backward(inputs=[w], retain_graph=True)
    assert model[0].weight.grad is None
    assert counter.backwards == 0
    assert_close(w.grad, want_w, what="w.grad")
    # The edges pointed elsewhere for that run are back: a second backward reaches them.
    out.sum().backward(inputs=[model[0].weight])
    assert counter.backwards == 1
    assert_close(model[0].weight.grad, want_weight, what="the Linear's weight grad")
