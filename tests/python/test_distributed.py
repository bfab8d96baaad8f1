"""gpipe.distributed.Pipe: 4 Gloo processes on localhost against the plain Sequential (float64, 1e-10).

The test spawns this file as 4 worker processes (``python test_distributed.py
SCENARIO`` with torch.distributed's environment); each worker checks its own
stages' grads against the plain model it also builds and prints one RESULT
line per check. Spawning costs seconds (each process imports torch), so one
spawn serves every check of a scenario.
"""
import copy
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

WORLD = 4
# What a spawn may take: 4 processes importing torch on 2 busy cores, then
# the steps.
SPAWN_DEADLINE = 150
# From the failing layer's raise to every rank's error.
FAILURE_DEADLINE = 10.0
# test_failing_rank_over_nccl: a killed peer shows at step_timeout over NCCL (seconds).
NCCL_STEP_TIMEOUT = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(scenario: str, world: int = WORLD, handoffs: str = "tagged", script: str = __file__,
           **env_vars: str) -> dict:
    """Runs ``python script scenario`` (this file's workers by default) on ``world`` processes
    with hand-offs matched by tag (Gloo's way) or by order (NCCL's, over Gloo here:
    GPIPE_HANDOFFS=ordered); returns {"results": {rank: [result, ...]}, "logs", "codes"}."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", GPIPE_HANDOFFS=handoffs,
                   **env_vars)
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        procs.append(subprocess.Popen([sys.executable, script, scenario], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + SPAWN_DEADLINE
    outputs = []
    hung = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            hung.append(rank)
        outputs.append(out)
    logs = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{o}"
                     for r, (p, o) in enumerate(zip(procs, outputs)))
    assert not hung, f"ranks {hung} did not finish within {SPAWN_DEADLINE} s (killed):\n{logs}"
    results = {}
    for rank, out in enumerate(outputs):
        results[rank] = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
                         if line.startswith("RESULT ")]
    return {"results": results, "logs": logs,
            "codes": [p.returncode for p in procs]}


# ---- the workers ---------------------------------------------------------------------------

from gpipe.skip import Namespace, pop, skippable, stash  # noqa: E402


@skippable(stash=["skip"])
class _Save(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class _Add(nn.Module):
    def forward(self, x):
        return x + (yield pop("skip"))


def _with_skips() -> nn.Sequential:
    """8 layers, two skips: 0 -> 7 and 3 -> 5 (across ranks under [2, 2, 2, 2] and [1] * 8)."""
    torch.manual_seed(0)
    a, b = Namespace(), Namespace()
    return nn.Sequential(_Save().isolate(a), nn.Linear(6, 6), nn.Tanh(), _Save().isolate(b),
                         nn.Linear(6, 6), _Add().isolate(b), nn.Tanh(),
                         _Add().isolate(a)).double()



class _Spread(nn.Module):
    def forward(self, x):
        return tuple(torch.tanh(x + k).unsqueeze(1) for k in range(8))


class _Each(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, xs):
        return tuple(self.linear(t) for t in xs)


class _Gather(nn.Module):
    def forward(self, xs):
        return torch.stack(xs).sum(0).squeeze(1)


def _wide() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Spread(), *[_Each() for _ in range(6)], _Gather()).double()


def _report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def _mlp(layers: int, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for k in range(layers):
        mods.append(nn.Linear(width, width) if k % 2 == 0 else nn.Tanh())
    return nn.Sequential(*mods).double()


def _max_grad_error(pipe, reference: nn.Sequential) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{name} got no grad"
        worst = max(worst, (p.grad.cpu() - ref[name].grad).abs().max().item())
    return worst


def _check_step(name: str, model: nn.Sequential, pipe, x, y, single=None) -> None:
    """Runs a train step per pair (x, y lists, or one pair) on the pipe and on the plain model
    (and, when given, on ``single``: the same model in a single-process gpipe.Pipe) and reports
    the worst errors."""
    reference = copy.deepcopy(model)
    pairs = list(zip(x, y)) if isinstance(x, list) else [(x, y)]
    worst = 0.0
    loss_error = 0.0
    for xs, ys in pairs:
        for p in list(pipe.parameters()) + list(reference.parameters()):
            p.grad = None
        loss = pipe.train_step(xs if pipe.is_first else None, target=ys if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        expected = nn.functional.mse_loss(reference(xs), ys)
        expected.backward()
        worst = max(worst, _max_grad_error(pipe, reference))
        if single is not None:
            for p in single.parameters():
                p.grad = None
            single.train_step(xs, ys, nn.functional.mse_loss)
            worst = max(worst, _max_grad_error(pipe, single))
        if pipe.is_last:
            loss_error = max(loss_error, (loss - expected.detach()).abs().item())
        else:
            assert loss is None
    _report(check=name, grad_error=worst, loss_error=loss_error,
            params=[n for n, _ in pipe.named_parameters()], stages=pipe.stages,
            handoffs=pipe._engine.handoffs)


def _worker_train() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(1)
    x = torch.randn(12, 6, dtype=torch.double)
    y = torch.randn(12, 6, dtype=torch.double)
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
                        ("zb_v", 2)):
        layers = 8 * v
        model = _mlp(layers)
        single = gpipe.Pipe(copy.deepcopy(model), [2] * (WORLD * v), chunks=4,
                            schedule=schedule, virtual_stages=v, devices=["cpu"] * WORLD)
        pipe = gpipe.distributed.Pipe(model, [2] * (WORLD * v),
                                      chunks=4, schedule=schedule, virtual_stages=v)
        _check_step(schedule, model, pipe, x, y, single)

    # Skips between ranks: straight from the stashing stage's rank to the popping one's.
    for schedule, v in (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zb_v", 2)):
        model = _with_skips()
        pipe = gpipe.distributed.Pipe(model, [2] * WORLD if v == 1 else [1] * (WORLD * v),
                                      chunks=4, schedule=schedule, virtual_stages=v)
        _check_step(f"skips-{schedule}", model, pipe, x, y)

    # Shapes change between steps: sequence lengths 3, 5, 5, 3 (a step with
    # last step's shapes, one with others).
    model = _mlp(8)
    pipe = gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4, schedule="1f1b")
    xs = [torch.randn(8, n, 6, dtype=torch.double) for n in (3, 5, 5, 3)]
    ys = [torch.randn(8, n, 6, dtype=torch.double) for n in (3, 5, 5, 3)]
    _check_step("shapes", model, pipe, xs, ys)

    # Tuples of 8 values between stages: a header longer than one message.
    model = _wide()
    pipe = gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4, schedule="1f1b")
    xs = [torch.randn(n, 6, dtype=torch.double) for n in (12, 12, 8)]
    ys = [torch.randn(n, 6, dtype=torch.double) for n in (12, 12, 8)]
    _check_step("wide", model, pipe, xs, ys)

    # Pipelined inference on the last rank.
    out = pipe.eval_step(x if pipe.is_first else None)
    if pipe.is_last:
        with torch.no_grad():
            _report(check="eval", error=(out - model(x)).abs().max().item())
    else:
        _report(check="eval", error=0.0 if out is None else 1.0)

    # Seeded steps with dropout on every rank are bitwise reproducible: one
    # worker per rank draws in its plan's fixed order.
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"):
        for checkpoint in ("always", "except_last", "never"):
            digests = [_seeded_dropout_steps(gpipe.distributed, schedule, checkpoint)
                       for _ in range(2)]
            _report(check=f"rng-{schedule}-{checkpoint}", same=digests[0] == digests[1],
                    digest=digests[0])

    dist.destroy_process_group()


def _seeded_dropout_steps(distributed, schedule: str, checkpoint: str) -> str:
    """Two seeded train steps of a fresh pipe over the ranks, dropout in every stage: the
    digest of this rank's loss, grads and next random numbers."""
    import hashlib

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(WORLD) for m in (nn.Linear(6, 6), nn.Dropout(0.4))])
    v = 2 if schedule in ("interleaved_1f1b", "zb_v") else 1
    pipe = distributed.Pipe(model.double(), [2 // v] * (WORLD * v), chunks=4, schedule=schedule,
                            virtual_stages=v, checkpoint=checkpoint)
    torch.manual_seed(7)
    seen = []
    for _ in range(2):
        x = torch.randn(12, 6, dtype=torch.double)
        y = torch.randn(12, 6, dtype=torch.double)
        loss = pipe.train_step(x if pipe.is_first else None, target=y if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        if loss is not None:
            seen.append(loss)
    seen += [p.grad for p in pipe.parameters()] + [torch.rand(4, dtype=torch.double)]
    h = hashlib.sha256()
    for t in seen:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker_cuda() -> None:
    """Stages on the GPU: over NCCL (one rank: NCCL takes one process per GPU) or over Gloo
    (every rank on GPU 0; tensors travel through the host)."""
    import torch.distributed as dist

    import gpipe.distributed

    backend = os.environ["GPIPE_TEST_BACKEND"]
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    # NCCL takes one GPU per process: rank r on GPU r (the test asks for enough).
    # Gloo's ranks share GPU 0.
    torch.cuda.set_device(dist.get_rank() if backend == "nccl" else 0)
    world = dist.get_world_size()
    torch.manual_seed(1)
    x = torch.randn(12, 6, dtype=torch.double)
    y = torch.randn(12, 6, dtype=torch.double)
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2)):
        model = _mlp(2 * world * v)
        reference = copy.deepcopy(model)
        # Over NCCL the device defaults to this rank's GPU; over Gloo, CPU.
        device = "cuda" if backend == "gloo" else None
        pipe = gpipe.distributed.Pipe(model, [2] * (world * v), chunks=4, schedule=schedule,
                                      virtual_stages=v, device=device)
        loss = pipe.train_step(x.cuda() if pipe.is_first else None,
                               target=y.cuda() if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        ref = dict(reference.named_parameters())
        error = max((p.grad.cpu() - ref[n].grad).abs().max().item()
                    for n, p in pipe.named_parameters())
        loss_error = (loss.cpu() - expected.detach()).abs().item() if pipe.is_last else 0.0
        _report(check=f"cuda-{schedule}", grad_error=error, loss_error=loss_error,
                devices=sorted({str(p.device) for p in pipe.parameters()}),
                handoffs=pipe._engine.handoffs)
    dist.destroy_process_group()


def _worker_dp() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    # Gloo on CPU, or NCCL with rank r on GPU r (test_pipeline_times_data_parallel_over_nccl).
    nccl = os.environ.get("GPIPE_TEST_BACKEND", "gloo") == "nccl"
    dist.init_process_group("nccl" if nccl else "gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if nccl:
        torch.cuda.set_device(rank)
    # 2 pipelines (ranks 0-1 and 2-3) of 2 stages; stage replicas 0-2 and 1-3.
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pipes[rank // 2], replicas[rank % 2]
    torch.manual_seed(1)
    x = torch.randn(12, 6, dtype=torch.double)
    y = torch.randn(12, 6, dtype=torch.double)
    model = _mlp(4)
    reference = copy.deepcopy(model)
    pipe = gpipe.distributed.Pipe(model, [2, 2], chunks=3, group=pp, dp_group=dp)
    half = slice(0, 6) if rank < 2 else slice(6, 12)
    on = (lambda t: t.cuda()) if nccl else (lambda t: t)
    pipe.train_step(on(x[half]) if pipe.is_first else None,
                    target=on(y[half]) if pipe.is_last else None, loss_fn=nn.functional.mse_loss)
    nn.functional.mse_loss(reference(x), y).backward()
    _report(check="pp_x_dp", grad_error=_max_grad_error(pipe, reference), stages=pipe.stages)
    dist.destroy_process_group()


def _worker_errors() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    x = torch.randn(8, 6, dtype=torch.double)
    errors = {}
    try:
        gpipe.distributed.Pipe(_mlp(8), [4, 4])
    except ValueError as e:
        errors["balance"] = str(e)
    # One rank's bad argument stops the step on every rank before anything
    # is sent; the same pipe then trains on (each case, then a good step).
    x16 = torch.randn(16, 6, dtype=torch.double)
    cases = {"input": (None if rank == 0 else x, x),
             "target": (x, None if rank == 3 else x),
             "rows": (x[:3] if rank == 0 else x, x),
             "target_rows": (x16, x16[:4]),
             "loss_fn": (x, x)}
    pipe = gpipe.distributed.Pipe(_mlp(8), [2, 2, 2, 2], chunks=4)
    for what, (xs, ys) in cases.items():
        loss_fn = "mse" if what == "loss_fn" and rank == 3 else nn.functional.mse_loss
        try:
            pipe.train_step(xs if pipe.is_first else None, target=ys if pipe.is_last else None,
                            loss_fn=loss_fn)
            errors[what] = None
        except Exception as e:
            errors[what] = f"{type(e).__name__}: {e}"
        loss = pipe.train_step(x if pipe.is_first else None, target=x if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
        errors[what + " then"] = None if loss is None else "loss"
    _report(check="errors", errors=errors)


class _Raises(nn.Module):
    """Raises in the forward of its second call (micro-batch 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            _report(check="raised", at=time.time())
            raise ValueError("layer 4 refuses micro-batch 1")
        return x


class _Dies(nn.Module):
    """Kills its process in the forward of its second call (micro-batch 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            _report(check="died", at=time.time())
            os._exit(3)
        return x


def _worker_fail() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    # Gloo on CPU, or NCCL with rank r on GPU r (test_failing_rank_over_nccl). NCCL reports
    # no closed connection: a killed peer shows at step_timeout. The group's timeout is long,
    # so NCCL's watchdog does not act on the failed step's leftover receives during the test.
    nccl = os.environ.get("GPIPE_TEST_BACKEND", "gloo") == "nccl"
    dist.init_process_group("nccl" if nccl else "gloo",
                            timeout=timedelta(seconds=300 if nccl else 60))
    if nccl:
        torch.cuda.set_device(dist.get_rank())
    model = _mlp(8)
    model[4] = _Raises()
    pipe = gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4, schedule="1f1b")
    x = torch.randn(8, 6, dtype=torch.double)
    if nccl:
        x = x.cuda()
    try:
        pipe.train_step(x if pipe.is_first else None, target=x if pipe.is_last else None,
                        loss_fn=nn.functional.mse_loss)
        _report(check="failure", error=None, at=time.time())
    except Exception as e:
        _report(check="failure", error=f"{type(e).__name__}: {e}", at=time.time())
    try:
        pipe.train_step(x if pipe.is_first else None, target=x if pipe.is_last else None,
                        loss_fn=nn.functional.mse_loss)
        _report(check="after", error=None)
    except Exception as e:
        _report(check="after", error=f"{type(e).__name__}: {e}")

    # Rank 2's process dies in its layer: the others lose it (a fresh group:
    # the failed step's is unusable).
    model = _mlp(8)
    model[4] = _Dies()
    pipe = gpipe.distributed.Pipe(model, [2, 2, 2, 2], chunks=4, schedule="1f1b",
                                  group=dist.new_group(),
                                  step_timeout=NCCL_STEP_TIMEOUT if nccl else None)
    try:
        pipe.train_step(x if pipe.is_first else None, target=x if pipe.is_last else None,
                        loss_fn=nn.functional.mse_loss)
        _report(check="killed", error=None, at=time.time())
    except Exception as e:
        _report(check="killed", error=f"{type(e).__name__}: {e}", at=time.time())


# ---- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tagged", "ordered"])
def train(request):
    run = _spawn("train", handoffs=request.param)
    run["handoffs"] = request.param
    return run


def _results(run, check):
    found = {r: [x for x in results if x["check"] == check]
             for r, results in run["results"].items()}
    missing = [r for r, x in found.items() if len(x) != 1]
    assert not missing, f"ranks {missing} did not report {check!r}:\n{run['logs']}"
    return {r: x[0] for r, x in found.items()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"])
def test_grads_equal_sequential(train, schedule):
    results = _results(train, schedule)
    for rank, r in results.items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)
        assert r["handoffs"] == train["handoffs"], (rank, r)
    # Every parameter on exactly one rank, under the Sequential's names.
    names = sorted(n for r in results.values() for n in r["params"])
    v = 2 if schedule in ("interleaved_1f1b", "zb_v") else 1
    assert names == sorted(n for n, _ in _mlp(8 * v).named_parameters())
    if schedule == "interleaved_1f1b":
        assert [results[r]["stages"] for r in range(WORLD)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    if schedule == "zb_v":  # in a V: the first and the last stage on rank 0
        assert [results[r]["stages"] for r in range(WORLD)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b", "zb_v"])
def test_skips_between_ranks(train, schedule):
    results = _results(train, f"skips-{schedule}")
    for rank, r in results.items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)
    names = sorted(n for r in results.values() for n in r["params"])
    assert names == sorted(n for n, _ in _with_skips().named_parameters())


def test_shapes_change_between_steps(train):
    for rank, r in _results(train, "shapes").items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)


def test_tuples_with_long_headers(train):
    for rank, r in _results(train, "wide").items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)


def test_eval_step(train):
    for rank, r in _results(train, "eval").items():
        assert r["error"] <= 1e-10, (rank, r)
    assert train["codes"] == [0] * WORLD, train["logs"]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"])
def test_seeded_steps_with_dropout_are_reproducible(train, schedule, checkpoint):
    """Each rank is one worker, so its stages draw in their plan's order: two seeded runs give
    bitwise the same losses and grads on every rank (issue 22 item 4)."""
    for rank, r in _results(train, f"rng-{schedule}-{checkpoint}").items():
        assert r["same"], (rank, r)


@pytest.mark.parametrize("handoffs", ["tagged", "ordered"])
def test_errors_name_value_and_fix(handoffs):
    run = _spawn("errors", handoffs=handoffs)
    expected = {
        "input": (0, "ValueError: rank 0 holds stage 0, so train_step needs the input here: "
                     "pass train_step(x if pipe.is_first else None, ...)"),
        "target": (3, "ValueError: rank 3 holds the last stage, so train_step needs the target "
                      "here: pass target=y if pipe.is_last else None"),
        "rows": (0, "ValueError: the input makes 3 micro-batches but every rank of the pipeline "
                    "runs chunks=4; give at least 4 rows"),
        "loss_fn": (3, "TypeError: loss_fn must be callable as loss_fn(output, target), got "
                       "'mse'"),
    }
    target_rows = ("ValueError: train_step's target has 4 rows along dim 0 (cut into [1, 1, 1, "
                   "1]) but the input has 16 along its batch dim (cut into [4, 4, 4, 4]); the "
                   "target is cut like the input: give one target row per input row")
    for rank, r in _results(run, "errors").items():
        errors = r["errors"]
        assert errors["balance"] == (
            "balance has 2 stages but the group has 4 ranks x virtual_stages 1 = 4 stages; pass "
            "4 entries (layers per stage; stage s runs on rank s % 4)"), errors
        for what, (culprit, message) in expected.items():
            if rank == culprit:
                assert errors[what] == message, (what, errors)
            else:
                # The others stop too (no hang, nothing sent), naming the culprit and its error.
                assert errors[what].startswith(f"ValueError: rank {culprit}'s train_step got bad "
                                               f"arguments ("), (what, errors)
                assert message.split(": ", 1)[1] in errors[what], (what, errors)
                assert "so no rank ran this step and nothing was sent" in errors[what], errors
        # A target cut unlike the input: every rank, before anything is sent.
        assert errors["target_rows"] == target_rows, errors
        # After each, the same pipe trains on.
        for what in list(expected) + ["target_rows"]:
            assert errors[what + " then"] == ("loss" if rank == 3 else None), (what, errors)
    assert run["codes"] == [0] * WORLD, run["logs"]


def test_pipeline_times_data_parallel():
    run = _spawn("dp")
    for rank, r in _results(run, "pp_x_dp").items():
        assert r["grad_error"] <= 1e-10, (rank, r)
    assert run["codes"] == [0] * WORLD, run["logs"]


@pytest.mark.parametrize("handoffs", ["tagged", "ordered"])
def test_failing_rank_stops_every_rank(handoffs):
    run = _spawn("fail", handoffs=handoffs)
    raised = _results({"results": {2: run["results"][2]}, "logs": run["logs"]}, "raised")[2]
    failures = _results(run, "failure")
    for rank, r in failures.items():
        assert r["error"] is not None, (rank, run["logs"])
        assert r["at"] - raised["at"] <= FAILURE_DEADLINE, (rank, r, raised)
        if rank == 2:
            assert r["error"].startswith("ValueError: layer 4 refuses micro-batch 1"), r
        else:
            assert "rank 2 failed" in r["error"] and "layer 4 refuses" in r["error"], r
    for rank, r in _results(run, "after").items():
        assert r["error"] is not None, (rank, r)
        assert "a previous step over this process group failed" in r["error"], (rank, r)
    # A rank killed: the others name it.
    died = _results({"results": {2: run["results"][2]}, "logs": run["logs"]}, "died")[2]
    killed = _results({"results": {r: run["results"][r] for r in (0, 1, 3)},
                       "logs": run["logs"]}, "killed")
    for rank, r in killed.items():
        assert r["error"] is not None and "rank 2" in r["error"], (rank, r)
        assert r["at"] - died["at"] <= FAILURE_DEADLINE, (rank, r, died)
    assert run["codes"][2] == 3 and [run["codes"][r] for r in (0, 1, 3)] == [0] * 3, run["logs"]


def test_failing_rank_over_nccl():
    """tests/gpu/run_multi.sh, 4 GPUs: over NCCL a rank whose layer raises stops every rank
    naming it, and a killed rank stops the others at step_timeout (NCCL reports no closed
    connection), the ranks waiting on it naming it. TORCH_NCCL_ASYNC_ERROR_HANDLING=2: should
    NCCL notice the death, its watchdog aborts the communicators (the waits then fail) instead
    of ending the process (3, torch's default)."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    run = _spawn("fail", handoffs="ordered", GPIPE_TEST_BACKEND="nccl",
                 TORCH_NCCL_ASYNC_ERROR_HANDLING="2")
    raised = _results({"results": {2: run["results"][2]}, "logs": run["logs"]}, "raised")[2]
    for rank, r in _results(run, "failure").items():
        assert r["error"] is not None, (rank, run["logs"])
        assert r["at"] - raised["at"] <= FAILURE_DEADLINE, (rank, r, raised)
        if rank != 2:
            assert "rank 2 failed" in r["error"] and "layer 4 refuses" in r["error"], r
    for rank, r in _results(run, "after").items():
        assert "a previous step over this process group failed" in r["error"], (rank, r)
    died = _results({"results": {2: run["results"][2]}, "logs": run["logs"]}, "died")[2]
    killed = _results({"results": {r: run["results"][r] for r in (0, 1, 3)},
                       "logs": run["logs"]}, "killed")
    for rank, r in killed.items():
        assert r["error"] is not None, (rank, r)
        # Ranks 1 and 3 wait on rank 2 itself; rank 0 on rank 1, which names rank 2 in turn
        # (or rank 0's own step_timeout names rank 1 first).
        assert f"rank {1 if rank == 0 else 2}" in r["error"], (rank, r)
        assert r["at"] - died["at"] <= NCCL_STEP_TIMEOUT + FAILURE_DEADLINE, (rank, r, died)
    assert [run["codes"][r] for r in (0, 1, 3)] == [0] * 3, run["logs"]


def test_pipeline_times_data_parallel_over_nccl():
    """tests/gpu/run_multi.sh, 4 GPUs: 2 pipelines x 2 replicas over NCCL, grads the plain
    model's."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    run = _spawn("dp", handoffs="ordered", GPIPE_TEST_BACKEND="nccl")
    for rank, r in _results(run, "pp_x_dp").items():
        assert r["grad_error"] <= 1e-10, (rank, r)
    assert run["codes"] == [0] * WORLD, run["logs"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend,world,handoffs", [("nccl", 1, "ordered"), ("gloo", 4, "tagged"),
                                                    ("gloo", 4, "ordered")])
def test_stages_on_the_gpu(backend, world, handoffs):
    """NCCL needs a GPU per process, so on one GPU: NCCL with one rank, and Gloo with 4 ranks'
    stages on the GPU (both hand-off modes)."""
    run = _spawn("cuda", world=world, handoffs=handoffs, GPIPE_TEST_BACKEND=backend)
    for schedule in ("1f1b", "interleaved_1f1b", "zb_h1", "zb_v"):
        for rank, r in _results(run, f"cuda-{schedule}").items():
            assert r["grad_error"] <= 1e-10, (schedule, rank, r)
            assert r["loss_error"] <= 1e-10, (schedule, rank, r)
            assert r["devices"] == [f"cuda:{rank if backend == 'nccl' else 0}"], (schedule, rank, r)
            assert r["handoffs"] == handoffs, (schedule, rank, r)
    assert run["codes"] == [0] * world, run["logs"]


@pytest.mark.parametrize("world", [2, 4])
def test_stages_on_several_gpus_over_nccl(world):
    """NCCL with one rank per GPU (tests/gpu/run_multi.sh, on a machine with >= ``world``
    GPUs): every schedule's loss and grads equal the plain model's."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, found {torch.cuda.device_count()}")
    run = _spawn("cuda", world=world, handoffs="ordered", GPIPE_TEST_BACKEND="nccl")
    for schedule in ("1f1b", "interleaved_1f1b", "zb_h1", "zb_v"):
        for rank, r in _results(run, f"cuda-{schedule}").items():
            assert r["grad_error"] <= 1e-10, (schedule, rank, r)
            assert r["loss_error"] <= 1e-10, (schedule, rank, r)
            assert r["devices"] == [f"cuda:{rank}"], (schedule, rank, r)


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                       "examples", "train_distributed.py")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_example_under_torchrun(schedule):
    """README's command: torchrun --nproc-per-node 4 examples/train_distributed.py (and with
    --schedule zb_v, the V over the ranks)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(WORLD), "--master-port", str(_free_port()), EXAMPLE,
                           "--schedule", schedule],
                          env=env, capture_output=True, text=True, timeout=SPAWN_DEADLINE)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count(": OK") == WORLD, out
    assert "step 4: loss" in out, out


def test_errors_without_a_group():
    import gpipe.distributed
    with pytest.raises(RuntimeError, match="init_process_group"):
        gpipe.distributed.Pipe(_mlp(4), [2, 2])


if __name__ == "__main__":
    {"train": _worker_train, "dp": _worker_dp, "fail": _worker_fail,
     "errors": _worker_errors, "cuda": _worker_cuda}[sys.argv[1]]()
