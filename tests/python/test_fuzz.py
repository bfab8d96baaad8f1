"""test_fuzz.py — runs the differential fuzzer (tests/fuzz/) over a fixed seed range."""
import copy
import functools
import importlib.util
import pathlib
import re
import sys

import torch
from torch import nn

import gpipe

FUZZ_DIR = pathlib.Path(__file__).resolve().parents[1] / "fuzz"

#: Seeds run here: a fixed, small range (seconds); `python3 tests/fuzz/fuzz.py --seeds 0:2000`
#: is the long run.
SEEDS = range(0, 400)


def load_fuzz():
    """tests/fuzz is not a package: load fuzz.py by path, registered as 'fuzz'; it puts its
    directory on sys.path, so its modules (layers, reference, compare, configs) import by name,
    as the printed reproductions do."""
    if "fuzz" in sys.modules:
        return sys.modules["fuzz"]
    spec = importlib.util.spec_from_file_location("fuzz", FUZZ_DIR / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz"] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def fixed_run():
    """The fixed range, run once for the tests that read its summary: (summary, lines)."""
    lines = []
    # No shrinking: the failure message lists each seed with its configuration as drawn;
    # `python3 tests/fuzz/fuzz.py --seed N` shrinks it and prints a runnable reproduction.
    return load_fuzz().run(SEEDS, do_shrink=False, write=lines.append), lines


def test_fixed_seeds_match_the_plain_model():
    summary, lines = fixed_run()
    assert summary.configurations == len(SEEDS)
    assert summary.mismatches == 0, (
        f"{summary.mismatches} mismatches in {summary.configurations} configurations "
        f"({summary.by_category}; {summary.cloned} compared against the boundary-cloned "
        f"model):\n" + "\n".join(lines))


def test_fixed_seeds_run_again_from_the_same_seed_in_every_schedule_and_mode():
    """Issue 22: every configuration whose Pipe ran without error runs it again from the same
    seed, bitwise the same; among them configurations whose dropout draws, in the drop-in
    call and under each train_step schedule and random tables, in each checkpoint mode and
    with one mode per stage, with several micro-batches."""
    fuzz = load_fuzz()
    summary, _ = fixed_run()
    assert summary.repeated >= 0.8 * len(SEEDS), summary
    wanted = (("drop-in",) + tuple(fuzz.SCHEDULES) + ("table",) + tuple(fuzz.MODES)
              + ("per-stage", "micro-batches"))
    assert all(summary.drawing.get(v, 0) >= 3 for v in wanted), summary.drawing
    assert summary.drawing["drawing"] >= 40, summary.drawing


def _pipe_with_dropout(chunks, checkpoint="never", schedule="gpipe"):
    fuzz = load_fuzz()
    f64 = torch.float64
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4, dtype=f64), fuzz.MaskDropout(0.5),
                          nn.Linear(4, 2, dtype=f64))
    ref = copy.deepcopy(model)
    return gpipe.Pipe(model, balance=[2, 1], devices=["cpu"] * 2, chunks=chunks,
                      checkpoint=checkpoint, schedule=schedule), ref


def test_a_pipe_drawing_otherwise_when_run_again_is_caught():
    """check runs the Pipe again from the seed its first run started from: a Pipe that draws
    other masks then (here: one more number drawn before each later call) is a
    'reproducibility' mismatch, though each run alone matches the plain model (whose dropout
    replays the Pipe's masks). The same Pipe left alone passes."""
    load_fuzz()
    from compare import check  # noqa: E402

    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    target = torch.randn(6, 2, dtype=torch.float64)
    for chunks, checkpoint in ((1, "never"), (3, "always")):
        for step in (None, target):
            for drifting in (False, True):
                pipe, ref = _pipe_with_dropout(chunks, checkpoint)
                if drifting:
                    forward, train_step, calls = pipe.forward, pipe.train_step, []

                    def drift():
                        calls.append(1)
                        if len(calls) > 1:
                            torch.rand(1)

                    pipe.forward = lambda x: (drift(), forward(x))[1]
                    pipe.train_step = lambda *a: (drift(), train_step(*a))[1]
                found = check(pipe, ref, x, target=step)
                kinds = {m.kind for m in found}
                assert found.repeated and found.drew
                if not drifting:
                    assert kinds == set(), (chunks, checkpoint, step is None)
                else:
                    assert "reproducibility:output" in kinds, (chunks, checkpoint, kinds)
                    assert {m.category for m in found} == {"reproducibility"}, kinds


def test_fixed_seeds_draw_ties_across_stages():
    """The fixed range ties a Linear's weight into later stages (a leaf whose grads two stages
    sum, in the fixed order the RNG rule promises): with several micro-batches, under
    train_step, in each checkpoint mode."""
    fuzz = load_fuzz()
    from configs import MODES, tie_spans  # noqa: E402

    drawn = {}
    for seed in SEEDS:
        cfg = fuzz.generate(seed)
        if "tie-crossing" not in cfg.features:
            continue
        assert max(tie_spans(cfg)) >= 1
        # A module configuration may checkpoint each stage its own way: counted as 'per-stage'.
        mode = cfg.checkpoint if isinstance(cfg.checkpoint, str) else "per-stage"
        for v in ("tie-crossing", mode, "train_step" if cfg.step else "drop-in") + (
                ("micro-batches",) if min(cfg.chunks, cfg.rows) > 1 else ()):
            drawn[v] = drawn.get(v, 0) + 1
    assert drawn.get("tie-crossing", 0) >= 30, drawn
    assert drawn.get("micro-batches", 0) >= 20, drawn
    assert all(drawn.get(v, 0) >= 5 for v in ("train_step", "drop-in") + MODES), drawn


def test_fixed_seeds_draw_the_batch_dim_variants():
    """The fixed range runs the Pipe's batch_dim / output_batch_dim: batch-second inputs and
    outputs, an input not cut, an output not joined."""
    fuzz = load_fuzz()
    drawn = {v: 0 for v in fuzz.BATCH_DIM_ODDS}
    for seed in SEEDS:
        for v in fuzz.generate(seed).features:
            drawn[v] = drawn.get(v, 0) + 1
    assert all(drawn[v] >= 5 for v in fuzz.BATCH_DIM_ODDS), drawn


def test_fixed_seeds_draw_every_train_step_schedule():
    """The fixed range runs pipe.train_step under each schedule, interleaved also with more
    than one stage per device."""
    fuzz = load_fuzz()
    # zb_v: drawn in place of some zb_h1; table: a random gpipe.Schedule in place of any.
    schedules = tuple(fuzz.STEP_KINDS)
    wanted = ("train_step",) + schedules + ("virtual_stages",)
    drawn = {v: 0 for v in wanted}
    for seed in SEEDS:
        for v in fuzz.generate(seed).features:
            if v in drawn:
                drawn[v] += 1
    assert all(drawn[v] >= 5 for v in wanted), drawn
    assert drawn["train_step"] == sum(drawn[s] for s in schedules), drawn


def test_train_step_configurations_build_their_pipe_as_drawn():
    """A train_step reproduction builds its Pipe with the schedule, and with interleaved
    virtual stages, one device per virtual_stages stages; shrinking keeps that valid."""
    fuzz = load_fuzz()
    from configs import _smaller  # noqa: E402 - on sys.path once fuzz.py is loaded

    cfg = next(fuzz.generate(s) for s in SEEDS if fuzz.generate(s).virtual_stages > 1
               and fuzz.generate(s).step == "interleaved_1f1b")
    body = cfg.body()
    assert f"schedule='interleaved_1f1b', virtual_stages={cfg.virtual_stages}" in body
    assert f"devices=['cpu'] * {len(cfg.balance) // cfg.virtual_stages}," in body
    assert "check(pipe, ref, inputs, target=target," in body
    for smaller in _smaller(cfg):
        assert smaller.step == cfg.step
        assert len(smaller.balance) % smaller.virtual_stages == 0, smaller.summary()


def test_table_configurations_build_their_pipe_as_drawn():
    """A random-table reproduction builds its Pipe with the table as a gpipe.Schedule, one
    device per row and the table's micro-batches as chunks; every shrink still has a table
    its Pipe accepts (the table is drawn anew for the stages, rows and micro-batches left)."""
    fuzz = load_fuzz()
    from configs import _smaller  # noqa: E402

    tables = [fuzz.generate(s) for s in SEEDS if getattr(fuzz.generate(s), "table", "")]
    assert {c.table for c in tables} == {"loop", "v"}
    for cfg in tables[:6]:
        body = cfg.body()
        assert "schedule=gpipe.Schedule.from_rows([[" in body
        assert f"devices=['cpu'] * {len(cfg.balance) // cfg.virtual_stages}," in body
        assert f"chunks={min(cfg.chunks, cfg.rows)}," in body
        for c in [cfg] + list(_smaller(cfg)):
            namespace = {"gpipe": gpipe}
            text = c._step_args()
            schedule = eval(text[len(", schedule="):], namespace)  # noqa: S307 - our own text
            assert schedule.rows == len(c.balance) // c.virtual_stages, c.summary()
            assert schedule.microbatches == c.microbatches(), c.summary()


def test_random_tables_are_valid_and_run_out_of_order():
    """configs.random_table gives tables gpipe.Schedule accepts, for loops and V's of 1 to 3
    stages per row, with whole and split backwards, idle ticks, and orders no built-in
    schedule makes: a stage's forwards out of micro-batch order, a W not right after its I."""
    load_fuzz()
    from configs import random_table  # noqa: E402 - on sys.path once fuzz.py is loaded

    seen = set()
    for seed in range(60):
        for stages, rows, v_shaped in ((1, 1, False), (3, 3, False), (4, 2, False),
                                       (4, 2, True), (6, 2, False), (6, 3, True)):
            table = random_table(seed, stages, rows, 4, v_shaped)
            schedule = gpipe.Schedule.from_rows(table)
            assert (schedule.rows, schedule.stages, schedule.microbatches) == (rows, stages, 4)
            assert schedule.v_shaped == v_shaped
            for row in table:
                seen.update({"idle"} if "" in row else set())
                actions = [re.fullmatch(r"(\d+)([FIWB])(\d+)", a).groups() for a in row if a]
                seen.update(op for _, op, _ in actions)
                by_stage = {}
                for stage, op, mb in actions:
                    if op == "F":
                        by_stage.setdefault(stage, []).append(int(mb))
                if any(order != sorted(order) for order in by_stage.values()):
                    seen.add("out of order")
                for k, (stage, op, mb) in enumerate(actions[:-1]):
                    if op == "I" and actions[k + 1] != (stage, "W", mb):
                        seen.add("W later")
    assert {"F", "B", "I", "W", "idle", "out of order", "W later"} <= seen, seen


def test_a_table_running_forwards_out_of_order_replays_the_masks_it_drew():
    """Dropout logs its masks in the order its stage ran the forwards; under a table that runs
    micro-batch 1 before 0 the references get them in micro-batch order, so the Pipe matches
    the plain model (handing them over in the order drawn made every such seed a mismatch)."""
    load_fuzz()
    from compare import check  # noqa: E402

    table = gpipe.Schedule.from_rows([["0F1", "0F0", "0B0", "0I1", "0W1"],
                                      ["1F1", "1F0", "1B1", "1B0"]])
    pipe, ref = _pipe_with_dropout(2, schedule=table)
    f64 = torch.float64
    x = torch.randn(6, 3, dtype=f64, requires_grad=True)
    target = torch.randn(6, 2, dtype=f64)
    found = check(pipe, ref, x, target=target)
    assert found.drew
    assert [m.kind for m in found] == [], [str(m) for m in found]


def test_stage_modes_reach_the_pipe_and_shrink_away():
    """A configuration with one checkpoint mode per stage builds its Pipe with the list (one
    mode per stage of its balance, also after a shrink merges stages), and shrinking tries it
    with the one mode first."""
    fuzz = load_fuzz()
    from configs import _smaller, stage_modes  # noqa: E402

    cfg = next(fuzz.generate(s) for s in SEEDS if "stage-modes" in fuzz.generate(s).features)
    assert f"checkpoint={stage_modes(cfg.seed, len(cfg.balance))!r}" in cfg.body()
    smaller = list(_smaller(cfg))
    assert any(not c.stage_modes for c in smaller)
    for c in smaller:
        if c.stage_modes:
            assert len(c.checkpoint_arg()) == len(c.balance)


def test_generation_is_deterministic():
    """A seed names one configuration: the reported seeds stay reproducible."""
    fuzz = load_fuzz()
    for seed in (0, 7, 1234):
        assert fuzz.generate(seed).body() == fuzz.generate(seed).body()


def _check(layers, balance, x, chunks=2, checkpoint="always", **kw):
    load_fuzz()
    from compare import check  # noqa: E402 - on sys.path once fuzz.py is loaded

    model = nn.Sequential(*layers)
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, balance=balance, devices=["cpu"] * len(balance), chunks=chunks,
                      checkpoint=checkpoint)
    return check(pipe, ref, x, **kw)


def _miscount(pipe, how):
    """Gives ``pipe`` a train_step that gets one thing wrong, to show check catches it."""
    right = pipe.train_step

    def train_step(x, target, loss_fn):
        if how == "scale":  # each micro-batch's loss doubled
            return right(x, target, lambda o, t: loss_fn(o, t) * 2)
        loss = right(x, target, loss_fn)
        return loss.requires_grad_() if how == "attached" else loss * 1.5

    pipe.train_step = train_step
    return pipe


def test_train_step_is_compared_with_the_plain_step():
    """With a target, check runs pipe.train_step against loss_fn(ref(x), target).backward():
    a Pipe that scales the loss wrongly, returns a wrong or an attached loss is caught."""
    load_fuzz()
    from compare import check  # noqa: E402

    f64 = torch.float64
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=f64, requires_grad=True)
    target = torch.randn(5, 2, dtype=f64)
    found = {}
    for how in (None, "scale", "attached", "value"):
        for schedule in ("gpipe", "zb_h1"):
            model = nn.Sequential(nn.Linear(3, 4, dtype=f64), nn.Tanh(),
                                  nn.Linear(4, 2, dtype=f64))
            ref = copy.deepcopy(model)
            pipe = gpipe.Pipe(model, balance=[2, 1], devices=["cpu"] * 2, chunks=3,
                              schedule=schedule)
            run = pipe if how is None else _miscount(pipe, how)
            found[how, schedule] = {m.kind for m in check(run, ref, x, target=target,
                                                          pre_grad=True)}
    for schedule in ("gpipe", "zb_h1"):
        assert found[None, schedule] == set()
        assert {"grad:value", "output:loss"} <= found["scale", schedule]
        assert found["attached", schedule] == {"requires_grad:loss"}
        assert found["value", schedule] == {"output:loss"}


def test_a_step_error_may_come_from_an_earlier_micro_batch_s_loss():
    """Seed 6539: micro-batch 0 passes RaiseIf but its loss requires no grad (the Pipe raises
    that RuntimeError in the loss phase, before micro-batch 1's forward trips RaiseIf, which
    the plain model raises first): allowed, as running micro-batch 0 alone raises it too. Any
    other error is a mismatch."""
    fuzz = load_fuzz()
    from compare import check  # noqa: E402

    x = torch.tensor([[0.5, 0.5], [0.5, 0.5], [5.0, 0.5], [0.5, 0.5]], dtype=torch.float64)
    target = torch.ones(4, 2, dtype=torch.float64)
    for wrong in (False, True):
        model = nn.Sequential(fuzz.RaiseIf(1.5))
        ref = copy.deepcopy(model)
        pipe = gpipe.Pipe(model, balance=[1], devices=["cpu"], chunks=2, checkpoint="never",
                          schedule="zb_h1")
        if wrong:
            def train_step(*args):
                raise ValueError("not what the plain model raises")
            pipe.train_step = train_step
        kinds = [m.kind for m in check(pipe, ref, x, target=target)]
        assert kinds == (["exception:train_step:pipe=ValueError:plain=FuzzError"] if wrong
                         else []), wrong


def test_inplace_refusals_are_compared_against_the_boundary_cloned_model():
    """The plain model refuses in-place work that gpipe's stage hand-over allows on purpose: the
    fuzzer compares those runs in full against the boundary-cloned model, and says so."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    # A first layer working in place on an input that requires grad: refused in forward.
    found = _check([nn.ReLU(inplace=True), nn.Linear(3, 2, dtype=torch.float64)], [1, 1], x)
    assert (found.reference, list(found)) == ("forward", [])
    # An in-place first layer of stage 1 spoils what stage 0 saved: refused in backward; the
    # checkpointed Pipe recomputes stage 0.
    found = _check([nn.Tanh(), nn.ReLU(inplace=True)], [1, 1], x)
    assert (found.reference, list(found)) == ("backward", [])
    # Anything else is compared against the plain model.
    found = _check([nn.Tanh(), nn.ReLU(inplace=True)], [2], x)
    assert found.reference is None


def test_no_grad_outputs_that_are_inputs():
    """Under no_grad the Pipe's outputs never require grad; the plain model may return its
    input, which does: only that flag is not compared."""
    fuzz = load_fuzz()
    x = (torch.randn(4, 2, dtype=torch.float64, requires_grad=True),
         torch.randn(4, 3, dtype=torch.float64, requires_grad=True))
    found = _check([fuzz.Swap(), fuzz.Swap()], [1, 1], x, no_grad=True)  # returns x
    assert list(found) == []


def test_the_boundary_cloned_model_follows_the_checkpoint_mode():
    """Seeds 2166, 6843: stage 1 works in place on stage 0's output, which is the caller's input
    that stage 0's in-place ReLU saved. A checkpointed stage 0 recomputes (no error); one that
    keeps its graph fails as the plain model would, in the Pipe and the reference alike."""
    f64 = torch.float64
    for chunks, checkpoint in ((1, "always"), (3, "always"), (1, "never"), (3, "except_last")):
        torch.manual_seed(0)
        x = torch.randn(3, 3, dtype=f64, requires_grad=True)
        layers = [nn.ReLU(inplace=True), nn.ReLU(inplace=True), nn.Linear(3, 2, dtype=f64)]
        found = _check(layers, [1, 2], x, chunks=chunks, checkpoint=checkpoint)
        assert (found.reference, list(found)) == ("forward", []), (chunks, checkpoint)


def test_a_forward_error_may_come_from_any_first_failing_micro_batch():
    """Seed 4967: micro-batch 0 passes RaiseIf and fails in the wrong-shaped Linear; micro-batch
    1 trips RaiseIf, which the plain model, going layer by layer, raises first."""
    fuzz = load_fuzz()
    x = torch.tensor([[0.5, 0.5, 0.5], [5.0, 0.5, 0.5]], dtype=torch.float64)
    layers = [fuzz.RaiseIf(2.0), nn.Linear(4, 2, dtype=torch.float64)]
    for chunks in (1, 2):
        assert list(_check(layers, [2], x, chunks=chunks, checkpoint="never")) == []


def test_float32_is_compared_relative_to_scale_and_float64_absolutely():
    load_fuzz()
    from compare import TOL, _diff  # noqa: E402

    f32, f64 = torch.float32, torch.float64
    assert _diff(torch.tensor([1000.0], dtype=f32), torch.tensor([1000.05], dtype=f32),
                 TOL["float32"], "ref") is None
    assert _diff(torch.tensor([0.0], dtype=f32), torch.tensor([3e-4], dtype=f32),
                 TOL["float32"], "ref") is not None
    assert _diff(torch.tensor([1000.0], dtype=f64), torch.tensor([1000.0 + 1e-9], dtype=f64),
                 TOL["float64"], "ref") is not None


def test_fixed_seeds_draw_skips_within_and_across_stages():
    """The fixed range draws skip connections (gpipe.skip) within a stage and across 1 and
    more stages, relays, namespaces, None skips, and under train_step with virtual stages."""
    fuzz = load_fuzz()
    from configs import skip_spans  # noqa: E402

    drawn, spans = {}, set()
    for seed in SEEDS:
        cfg = fuzz.generate(seed)
        for v in cfg.features:
            drawn[v] = drawn.get(v, 0) + 1
        if "skips" in cfg.features:
            spans |= set(skip_spans(cfg).values())
            if cfg.virtual_stages > 1:
                drawn["skips+virtual"] = drawn.get("skips+virtual", 0) + 1
    for v in ("skips", "skip-crossing", "skip-namespace", "skip-none", "relay"):
        assert drawn.get(v, 0) >= 3, (v, drawn)
    assert drawn.get("skips+virtual", 0) >= 1, drawn
    assert {0, 1, 2} <= spans, spans


def test_skip_configurations_shrink_to_valid_models():
    """Shrinking drops a skip's stash, relays and pop together, never one alone: every
    smaller configuration still passes gpipe's verify_skippables, and its snippet builds."""
    fuzz = load_fuzz()
    from configs import _smaller  # noqa: E402
    from gpipe.skip import verify_skippables

    checked = 0
    for seed in SEEDS:
        cfg = fuzz.generate(seed)
        if "relay" not in cfg.features and "skip-namespace" not in cfg.features:
            continue
        for smaller in [cfg] + list(_smaller(cfg)):
            body = smaller.body().split("model = nn.Sequential")[0]
            namespace = {n: getattr(sys.modules["layers"], n)
                         for n in sys.modules["layers"].__all__}
            namespace.update(torch=torch, nn=nn)
            exec(body, namespace)
            verify_skippables(nn.Sequential(*namespace["layers"]))
            checked += 1
    assert checked > 20


def test_a_pipe_delivering_a_wrong_skip_is_caught(monkeypatch):
    """The fuzzer sees skips: a Pipe whose stages receive their crossing skips doubled
    mismatches on the seeds with a crossing skip that matters, and on no other seed."""
    fuzz = load_fuzz()
    from gpipe.skip import tracker

    seeds = [s for s in SEEDS if "skip-crossing" in fuzz.generate(s).features][:12]
    right = tracker.StageRunner.__call__

    def doubled(self, input, skips=()):
        return right(self, input, tuple(None if t is None else t * 2 for t in skips))

    monkeypatch.setattr(tracker.StageRunner, "__call__", doubled)
    lines = []
    summary = fuzz.run(seeds, do_shrink=False, write=lines.append)
    assert summary.mismatches >= len(seeds) // 2, lines
    # Not the module configurations: gpipe.pipeline routes values as skips of its own
    # (test_a_pipeline_delivering_a_wrong_skip_is_caught).
    others = [s for s in SEEDS if not {"skip-crossing", "pipeline"} & set(
        fuzz.generate(s).features)][:20]
    assert fuzz.run(others, do_shrink=False, write=lines.append).mismatches == 0, lines


def test_fixed_seeds_draw_modules_through_pipeline():
    """Issue: the fuzzer draws some models as plain nn.Modules through gpipe.pipeline. The fixed
    range holds at least 30 of them, all matching the module, with edges and ties across
    stages, a keyword tensor not cut, tuple and dict outputs, a split point inside a block,
    several micro-batches and train_step under each schedule (virtual stages too)."""
    fuzz = load_fuzz()
    summary, lines = fixed_run()
    drawn = {}
    for seed in SEEDS:
        cfg = fuzz.generate(seed)
        if "pipeline" not in cfg.features:
            continue
        for v in cfg.features + (["micro-batches"] if min(cfg.chunks, cfg.rows) > 1 else []):
            drawn[v] = drawn.get(v, 0) + 1
    assert drawn.get("pipeline", 0) >= 30, drawn
    assert summary.pipelines["pipeline"] == drawn["pipeline"], summary.pipelines
    assert not [line for line in lines if "| module " in line], lines  # all of them match
    for v in ("edge-crossing", "tie-crossing", "shared-kwarg", "tuple-output", "dict-output",
              "split-inside", "second-input", "size", "dropout", "micro-batches",
              "train_step") + tuple(fuzz.SCHEDULES):
        assert drawn.get(v, 0) >= 2, (v, drawn)
    assert drawn.get("virtual_stages", 0) >= 1, drawn


def test_module_configurations_are_reproducible_from_their_seed():
    """A module configuration's printed reproduction builds the same module again: the snippet
    run on its own (as `fuzz.py --seed N` prints it) gives the module the fuzzer checked."""
    fuzz = load_fuzz()
    seed = next(s for s in SEEDS if "pipeline" in fuzz.generate(s).features)
    cfg = fuzz.generate(seed)
    assert cfg.snippet() == fuzz.generate(seed).snippet()
    states = []
    for _ in range(2):
        namespace = {}
        exec(compile(cfg.snippet(), f"<seed {seed}>", "exec"), namespace)
        assert list(namespace["mismatches"]) == []
        states.append(namespace["ref"].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(states[0].values(), states[1].values()))


def test_a_pipeline_delivering_a_wrong_skip_is_caught(monkeypatch):
    """The module configurations see what gpipe.pipeline routes: with the values it sends
    past stages as skips doubled, many of them mismatch."""
    fuzz = load_fuzz()
    from gpipe.skip import tracker

    seeds = [s for s in SEEDS if "pipeline" in fuzz.generate(s).features][:12]
    right = tracker.StageRunner.__call__

    def doubled(self, input, skips=()):
        return right(self, input, tuple(None if t is None else t * 2 for t in skips))

    monkeypatch.setattr(tracker.StageRunner, "__call__", doubled)
    lines = []
    assert fuzz.run(seeds, do_shrink=False, write=lines.append).mismatches >= 2, lines
