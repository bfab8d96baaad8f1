"""Shared test helpers: seeding, exact comparisons against a plain copy, hang timeouts."""
import copy
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pytest
import torch
from torch import Tensor, nn

import gpipe

#: Transparency tolerance in float64: the Pipe equals the plain model up to summation order. Never loosen it.
TOL = 1e-10

CPU = torch.device("cpu")

#: Seconds any single Pipe call may take before a test calls it a hang.
HANG_TIMEOUT = 60.0

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


#: Every checkpoint mode.
MODES = ["always", "except_last", "never"]


def mlp() -> nn.Sequential:
    """Seven float64 layers; the in-place ReLUs at 1 and 5 open a stage under several balances."""
    return nn.Sequential(
        nn.Linear(5, 8),          # 0
        nn.ReLU(inplace=True),    # 1
        nn.Linear(8, 8),          # 2
        nn.GELU(),                # 3
        nn.LayerNorm(8),          # 4
        nn.ReLU(inplace=True),    # 5
        nn.Linear(8, 3),          # 6
    ).double()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def as_tuple(x: TensorOrTensors) -> Tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def token_ids(rows: int, vocab: int, length: int) -> Tensor:
    """Random token ids, ``(rows, length)``, below ``vocab``: a language model's input."""
    return torch.randint(0, vocab, (rows, length))


def padding_mask(rows: int, length: int) -> Tensor:
    """An attention mask with 3 to ``length`` real tokens per row (the padding at the end)."""
    return (torch.arange(length) < torch.randint(3, length + 1, (rows, 1))).long()


def lm_loss(out: Any, tgt: Tensor) -> Tensor:
    """Cross entropy of a Hugging Face causal LM's ``logits`` against the next tokens."""
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                             tgt.reshape(-1))


def leaf_copy(x: TensorOrTensors) -> TensorOrTensors:
    """Detached copies that keep each tensor's requires_grad (a fresh leaf per run)."""
    if isinstance(x, tuple):
        return tuple(leaf_copy(t) for t in x)  # type: ignore[misc]
    return x.detach().clone().requires_grad_(x.requires_grad)


def max_diff(a: Optional[Tensor], b: Optional[Tensor]) -> float:
    """Largest elementwise difference, compared on the CPU (a and b may live on different devices)."""
    assert a is not None and b is not None, "one side has no tensor (missing grad?)"
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"dtypes differ: {a.dtype} vs {b.dtype}"
    if a.numel() == 0:
        return 0.0
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()


def assert_close(a: TensorOrTensors, b: TensorOrTensors, tol: float = TOL, what: str = "") -> None:
    a, b = as_tuple(a), as_tuple(b)
    assert len(a) == len(b), f"{what}: {len(a)} tensors vs {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        d = max_diff(x, y)
        assert d <= tol, f"{what}[{k}]: max difference {d:.3e} > {tol:.0e}"


def assert_same_grads(pipe: nn.Module, ref: nn.Module, tol: float = TOL) -> None:
    """Every parameter has a grad equal to the reference's (same names, same order)."""
    got = dict(pipe.named_parameters())
    want = dict(ref.named_parameters())
    assert list(got) == list(want)
    assert want, "the model has no parameters: the check would be vacuous"
    for name, p in want.items():
        if p.grad is None:
            assert got[name].grad is None, f"{name}: the Pipe has a grad, the reference none"
            continue
        assert got[name].grad is not None, f"{name}: the Pipe left no grad"
        d = max_diff(got[name].grad, p.grad)
        assert d <= tol, f"grad of {name}: max difference {d:.3e} > {tol:.0e}"


def output_weights(out: TensorOrTensors, seed: int = 1) -> Tuple[Tensor, ...]:
    """Fixed random weights for a loss sum(w * out): every output element gets its own grad."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point()
                 else torch.zeros(0) for t in as_tuple(out))


def weighted_loss(out: TensorOrTensors, weights: Sequence[Tensor]) -> Tensor:
    terms = [(t * w).sum() for t, w in zip(as_tuple(out), weights) if t.is_floating_point()]
    return torch.stack(terms).sum()


def compare_with_plain(model: nn.Sequential, x: TensorOrTensors, backward: bool = True,
                       **pipe_kwargs: Any) -> Tuple[gpipe.Pipe, nn.Sequential]:
    """Runs ``model`` plainly (on a deepcopy) and as a Pipe, forward and
    backward, and asserts outputs, input grads and parameter grads agree."""
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, **pipe_kwargs)
    x_ref, x_pipe = leaf_copy(x), leaf_copy(x)

    want = ref(x_ref)
    got = pipe(x_pipe)
    assert isinstance(got, tuple) == isinstance(want, tuple)
    assert_close(got, want, what="output")
    if not backward:
        return pipe, ref

    weights = output_weights(want)
    weighted_loss(want, weights).backward()
    weighted_loss(got, weights).backward()
    for k, (a, b) in enumerate(zip(as_tuple(x_pipe), as_tuple(x_ref))):
        if b.requires_grad:
            assert_close(a.grad, b.grad, what=f"input grad {k}")
    assert_same_grads(pipe, ref)
    return pipe, ref


def call_with_timeout(fn: Callable[[], Any], timeout: float = HANG_TIMEOUT) -> Dict[str, Any]:
    """Runs ``fn`` in a thread; fails the test if it is still running after
    ``timeout`` seconds. Returns {'result': ...} or {'error': exception}."""
    outcome: Dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as e:  # noqa: B902 - handed to the test as is
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"the call did not return within {timeout:.0f} s: the pipeline hangs")
    return outcome


def result(fn: Callable[[], Any]) -> Any:
    """``fn()`` under the hang timeout; its exception, if any, is raised here."""
    outcome = call_with_timeout(fn)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def raises_within_timeout(fn: Callable[[], Any], timeout: float = HANG_TIMEOUT) -> BaseException:
    """The exception ``fn`` raises (in a thread, with a hang timeout); fails if none."""
    outcome = call_with_timeout(fn, timeout)
    if "error" not in outcome:
        pytest.fail(f"expected an exception, got the result {outcome.get('result')!r}")
    return outcome["error"]


def check_recovers(pipe: gpipe.Pipe, ref: nn.Sequential, device: torch.device = CPU) -> None:
    """After a failure: disarmed, the same Pipe is transparent again (input on ``device``,
    7 rows: an uneven last micro-batch for 4 chunks)."""
    for m in list(pipe) + list(ref):
        if hasattr(m, "armed"):
            m.armed = False
    pipe.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    x = torch.randn(7, 3, dtype=torch.float64, device=device)
    x_pipe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = result(lambda: pipe(x_pipe))
    want = ref(x_ref)
    assert max_diff(out, want) <= TOL
    result(lambda: out.pow(2).sum().backward())
    want.pow(2).sum().backward()
    assert max_diff(x_pipe.grad, x_ref.grad) <= TOL
    assert_same_grads(pipe, ref)


def notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


class Counter(nn.Module):
    """Identity layer that counts forward calls (and backward calls via an autograd Function)."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards: List[Tuple[bool, bool]] = []
        self.backwards = 0

    def forward(self, x: Tensor) -> Tensor:
        self.forwards.append((gpipe.is_checkpointing(), gpipe.is_recomputing()))
        return _CountBackward.apply(x, self)


class _CountBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, counter: Counter) -> Tensor:  # type: ignore[override]
        ctx.counter = counter
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        ctx.counter.backwards += 1
        return grad, None


class Sleep(nn.Module):
    """Sleeps ``seconds`` in forward, then scales by a parameter (so backward reaches it)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x * self.scale


# -- layers that fail --------------------------------------------------------------------------

class MyError(Exception):
    pass


class RaiseOnMicrobatch(nn.Module):
    """Identity that raises ``error`` on its ``n``-th forward call (micro-batch n of a
    first forward) while armed."""

    def __init__(self, error: BaseException, n: int) -> None:
        super().__init__()
        self.error, self.n, self.calls, self.armed = error, n, 0, True

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.armed and self.calls == self.n + 1:
            raise self.error
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, owner: "RaiseInBackward") -> Tensor:  # type: ignore[override]
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        ctx.owner.backwards += 1
        if ctx.owner.armed:
            raise ctx.owner.error
        return grad, None


class RaiseInBackward(nn.Module):
    """Identity whose backward raises ``error`` while armed; counts its backwards."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error
        self.armed = True
        self.backwards = 0

    def forward(self, x: Tensor) -> Tensor:
        return _RaiseInBackward.apply(x, self)
