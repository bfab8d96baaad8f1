"""Transparency: outputs, input grads and parameter grads equal the plain Sequential's (1e-10)."""
import copy
import itertools
from typing import Tuple

import pytest
import torch
from torch import Tensor, nn

import gpipe
from conftest import (MODES, TOL, TensorOrTensors, assert_close, assert_same_grads,
                      compare_with_plain, leaf_copy, mlp, output_weights, weighted_loss)

# [7]: a single stage; [1]*7: one layer per stage; [1, 6], [1, 4, 2] and
# [3, 2, 2]: an in-place ReLU is the first layer of a stage.
BALANCES = [[7], [1] * 7, [1, 6], [1, 4, 2], [3, 2, 2]]


@pytest.mark.parametrize("batch", [2, 7, 30])
@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
@pytest.mark.parametrize("balance", BALANCES, ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("checkpoint", MODES)
def test_mlp(checkpoint, balance, chunks, batch):
    x = torch.randn(batch, 5, dtype=torch.float64, requires_grad=True)
    compare_with_plain(mlp(), x, balance=balance, chunks=chunks, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_single_row(checkpoint):
    x = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)
    compare_with_plain(mlp(), x, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)


class Merge(nn.Module):
    """Takes a tuple of tensors as ONE argument, as torchgpipe's first layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tensor:
        a, b = inputs
        return torch.tanh(self.a(a)) * self.b(b)


class Split(nn.Module):
    """Tensor -> (tensor, tensor): a tuple crosses the next stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.lin(x), torch.sin(x)


class Mix(nn.Module):
    """(tensor, tensor) -> (tensor, tensor), with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        h, g = inputs
        return torch.relu(self.lin(h) + g), h * g


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tensor:
        h, g = inputs
        return self.lin(h - 0.5 * g)


def tuple_model(end_with_tuple: bool = False) -> nn.Sequential:
    layers = [Merge(), Split(), Mix(), Mix()]
    if not end_with_tuple:
        layers.append(Join())
    return nn.Sequential(*layers).double()


def tuple_input(batch: int) -> Tuple[Tensor, Tensor]:
    return (torch.randn(batch, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(batch, 3, dtype=torch.float64, requires_grad=True))


@pytest.mark.parametrize("batch,chunks", [(7, 3), (2, 5), (8, 1), (8, 4)])
@pytest.mark.parametrize("balance", [[5], [1, 1, 1, 1, 1], [2, 2, 1], [1, 3, 1]],
                         ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_input_and_tuples_between_stages(checkpoint, balance, chunks, batch):
    compare_with_plain(tuple_model(), tuple_input(batch), balance=balance, chunks=chunks,
                       checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_output(checkpoint):
    _, ref = compare_with_plain(tuple_model(end_with_tuple=True), tuple_input(7),
                                balance=[1, 2, 1], chunks=3, checkpoint=checkpoint)
    with torch.no_grad():
        assert isinstance(ref(tuple_input(7)), tuple)  # so the Pipe's was one too


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_input_with_one_element_not_requiring_grad(checkpoint):
    a, b = tuple_input(7)
    compare_with_plain(tuple_model(), (a, b.detach()), balance=[2, 3], chunks=3,
                       checkpoint=checkpoint)


class Masked(nn.Module):
    """Carries an integer mask (no grad) through the stages next to the activations."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inputs: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        x, mask = inputs
        return torch.tanh(self.lin(x)) * mask.to(x.dtype).unsqueeze(1), mask


@pytest.mark.parametrize("checkpoint", MODES)
def test_integer_tensor_passes_between_stages(checkpoint):
    model = nn.Sequential(Masked(), Masked(), Masked()).double()
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.randint(0, 2, (9,))
    compare_with_plain(model, (x, mask), balance=[1, 1, 1], chunks=4, checkpoint=checkpoint)


class Narrow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:, :2]  # a view of the stage input


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("name,layers,balance", [
    ("identity-stages", lambda: [nn.Linear(3, 3), nn.Identity(), nn.Identity(), nn.Linear(3, 2)],
     [1, 1, 1, 1]),
    ("view-then-inplace", lambda: [nn.Linear(3, 3), Narrow(), nn.ReLU(inplace=True),
                                   nn.Linear(2, 2)], [1, 1, 2]),
    ("parameterless-first-stage", lambda: [nn.Tanh(), nn.ReLU(), nn.Linear(3, 2)], [2, 1]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_unusual_stages(checkpoint, name, layers, balance):
    model = nn.Sequential(*layers()).double()
    for x in (torch.randn(5, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(5, 3, dtype=torch.float64)):
        compare_with_plain(copy.deepcopy(model), x, balance=balance, chunks=2,
                           checkpoint=checkpoint)


def _backward_from_part(net: nn.Module, x: TensorOrTensors) -> Tuple[Tensor, ...]:
    """Backward from the first two rows of the output, or from the first
    element of a tuple output (the second gets no grad); returns the input
    grads. The graph dies in this frame."""
    x = leaf_copy(x)
    out = net(x)
    part = out[0] if isinstance(out, tuple) else out[:2]
    part.sum().backward()
    return tuple(t.grad for t in (x if isinstance(x, tuple) else (x,)))


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("which", ["rows", "tuple-element"])
def test_backward_from_part_of_the_output(checkpoint, which):
    if which == "rows":
        model, x = mlp(), torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    else:
        model, x = tuple_model(end_with_tuple=True), tuple_input(7)
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, len(model) - 2], chunks=3, checkpoint=checkpoint)
    assert_close(_backward_from_part(pipe, x), _backward_from_part(ref, x), what="input grad")
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", MODES)
def test_two_graphs_alive_at_once(checkpoint):
    """Two forwards before one backward over both (each call keeps its own cells)."""
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)
    x1, x2 = torch.randn(5, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    (ref(x1).pow(2).sum() + ref(x2).sum()).backward()
    (pipe(x1).pow(2).sum() + pipe(x2).sum()).backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", MODES)
def test_input_without_grad(checkpoint):
    x = torch.randn(7, 5, dtype=torch.float64)
    compare_with_plain(mlp(), x, balance=[3, 2, 2], chunks=3, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_frozen_first_stage(checkpoint):
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    x = torch.randn(7, 5, dtype=torch.float64)
    compare_with_plain(model, x, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_grads_accumulate_over_calls(checkpoint):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)
    for _ in range(3):
        x = torch.randn(7, 5, dtype=torch.float64)
        w = output_weights(ref(x))
        weighted_loss(ref(x), w).backward()
        weighted_loss(pipe(x), w).backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", MODES)
def test_backward_twice_with_retain_graph(checkpoint):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 5], chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    x_ref = leaf_copy(x)
    want, got = ref(x_ref), pipe(x)
    w = output_weights(want)
    for _ in range(2):
        weighted_loss(want, w).backward(retain_graph=True)
        weighted_loss(got, w).backward(retain_graph=True)
    assert_close(x.grad, x_ref.grad, what="input grad")
    assert_same_grads(pipe, ref)
    del got  # before the Pipe goes: see test_api.py::test_output_outlives_pipe


@pytest.mark.parametrize("checkpoint", MODES)
def test_output_feeds_a_second_model(checkpoint):
    """The Pipe is one node inside a larger graph: grads flow through it both ways."""
    model, head = mlp(), nn.Linear(3, 1).double()
    ref, ref_head = copy.deepcopy(model), copy.deepcopy(head)
    stem = nn.Linear(5, 5).double()
    ref_stem = copy.deepcopy(stem)
    pipe = gpipe.Pipe(model, balance=[1, 4, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 5, dtype=torch.float64)
    head(pipe(stem(x))).pow(2).sum().backward()
    ref_head(ref(ref_stem(x))).pow(2).sum().backward()
    assert_same_grads(pipe, ref)
    assert_same_grads(stem, ref_stem)
    assert_same_grads(head, ref_head)


@pytest.mark.parametrize("checkpoint", MODES)
def test_adam_steps(checkpoint):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)
    initial = copy.deepcopy(ref)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    target = torch.randn(10, 3, dtype=torch.float64)
    for _ in range(5):
        x = torch.randn(10, 5, dtype=torch.float64)
        for net, o in ((pipe, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(net(x), target).backward()
            o.step()
    params = dict(pipe.named_parameters())
    moved = 0.0
    for name, p in ref.named_parameters():
        assert (params[name] - p).abs().max().item() <= TOL, name
    for p, p0 in zip(ref.parameters(), initial.parameters()):
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-3, "the optimizer did not move the parameters: the check is vacuous"


@pytest.mark.parametrize("chunks", [1, 3])
def test_eval_outputs(chunks):
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(inplace=True),
                          nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=chunks)
    pipe.eval()
    ref.eval()
    assert not any(m.training for m in pipe.modules())
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    x_ref = leaf_copy(x)
    out, want = pipe(x), ref(x_ref)
    assert_close(out, want, what="eval output")
    # Grad mode stays on in eval: the graph works and is transparent.
    out.sum().backward()
    want.sum().backward()
    assert_close(x.grad, x_ref.grad, what="eval input grad")
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("checkpoint", MODES)
def test_no_grad_outputs(checkpoint, training):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)
    pipe.train(training)
    ref.train(training)
    for batch in (1, 7, 12):
        x = torch.randn(batch, 5, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            out = pipe(x)
            want = ref(x)
        assert not out.requires_grad and out.grad_fn is None
        assert_close(out, want, what=f"no_grad output, batch {batch}")


@pytest.mark.parametrize("checkpoint", MODES)
def test_inference_mode_outputs(checkpoint):
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=[1, 4, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 5, dtype=torch.float64)
    with torch.inference_mode():
        out, want = pipe(x), ref(x)
    assert not out.requires_grad
    assert_close(out, want, what="inference_mode output")


def test_many_configurations_share_no_state():
    """Several Pipes over fresh models alive at once stay independent."""
    pipes, refs, xs = [], [], []
    for balance, chunks in itertools.product([[2, 5], [1, 1, 5]], [2, 3]):
        model = mlp()
        refs.append(copy.deepcopy(model))
        pipes.append(gpipe.Pipe(model, balance=balance, chunks=chunks))
        xs.append(torch.randn(5, 5, dtype=torch.float64))
    for pipe, ref, x in zip(pipes, refs, xs):
        assert_close(pipe(x), ref(x), what="output")
