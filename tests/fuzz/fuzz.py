"""fuzz.py — the differential fuzzer's command line: random models, gpipe.Pipe vs the plain model.

For each seed it draws a random model and configuration (:mod:`configs`), runs
the model as ``gpipe.Pipe(model, balance=..., devices=['cpu'] * K, ...)`` and
as a deep copy of the plain Sequential, and compares everything observable
(:mod:`compare`; the layer kinds are in :mod:`layers`). About a third of the
configurations run the training step inside the pipeline instead,
``pipe.train_step(x, target, loss_fn)`` under one of the schedules 'gpipe',
'1f1b', 'interleaved_1f1b' (also with 2 or 3 virtual stages per device),
'zb_h1' and 'zb_v', or (about 3 in 10 of them) under a random table given as a
``gpipe.Schedule`` (:func:`configs.random_table`: 1 to 3 stages per row, in a
loop or in a V, each backward whole or split into I and W, the rows' orders
from one random serial run of the tasks, so stages may run their micro-batches
out of order and W's long after their I's), against
``loss_fn(model(x), target).backward()``: the returned loss, every grad and
exceptions are compared. About a quarter of the configurations of several
stages give the Pipe one checkpoint mode per stage, and about 3 in 10 pass
their float inputs as views at an odd offset (a slice from the second row on:
kernels may give other last bits at another alignment). About a quarter of the
configurations carry skip connections (``gpipe.skip``: 1 to 3 stash/pop pairs,
relays, None skips, names reused through ``Namespace`` / ``isolate``) that the
balance leaves in a stage or routes across 1 to K-1 stages, also under
train_step and with virtual stages; the plain Sequential of the same
skippable layers is the reference. Where the plain model
refuses an in-place operation that gpipe's stage hand-over allows on purpose,
the Pipe is compared against the boundary-cloned model instead; the last line
counts those configurations. About a seventh of the configurations tie a
Linear's weight into a later stage. About a fifth of the seeds draw a plain
``nn.Module`` instead (:mod:`modules`: a chain of blocks whose forward adds,
concatenates or multiplies in earlier values, ties weights, takes a keyword
tensor not cut by batch and returns a tensor, tuple, list or dict), cut by
``gpipe.pipeline`` at 1 to 3 blocks and compared with the module itself, also
under train_step; they are printed as reproductions as drawn (not shrunk).
Every configuration whose Pipe ran
without error runs it again from the same seed (the generator state its
first run started from), which must give bitwise the same outputs, loss and
grads: dropout reproducibility and the fixed order of grad sums (README,
"Random numbers"; :func:`compare._repeat`).

The documented run (0:2000, about 35 s on one CPU core) ends::

    fuzz: skips: 350 configurations (250 crossing stages)
    fuzz: pipeline: 406 module configurations through gpipe.pipeline (edge-crossing 331, ...)
    fuzz: reproducibility: 1700 configurations run again from the same seed, ...
    fuzz: 2000 configurations, 0 mismatches (57 compared against the boundary-cloned model)

Seed 9172 (a random table running micro-batch 1 first) found that a checkpointed
cell's recompute could differ from its forward in the last bits: the first cell
of a stage recomputed from a copy of its input, on which this CPU's BLAS took
another path (fixed: tests/python/test_checkpoint.py::test_a_recompute_is_bitwise_its_forward).

Seed 939 found that freeing a Pipe after its backward raised could hang the
process (fixed; tests/python/test_skip.py::test_freeing_a_pipe_after_a_backward_error).

Usage (from the repository root, gpipe installed)::

    python3 tests/fuzz/fuzz.py --seeds 0:2000          # the documented run
    python3 tests/fuzz/fuzz.py --seed 17               # one seed, with a runnable reproduction
    python3 tests/fuzz/fuzz.py --seeds 0:500 --only-category grad,exception
    python3 tests/fuzz/fuzz.py --seeds 0:500 --without external,closure,cond-dropout
    python3 tests/fuzz/fuzz.py --seeds 0:5000 --with zb_h1   # only train_step under zb_h1
    python3 tests/fuzz/fuzz.py --seeds 0:5000 --with skip-crossing  # skips between stages
    python3 tests/fuzz/fuzz.py --seeds 0:50 --verbose  # every config, snippets for failures

Output: for every failing configuration one line per mismatch category::

    seed 17 [grad] 3.W.grad: max diff 2.0e+00 > 1e-10 (+1 more) | layers=[...] balance=[...] ...

where the configuration shown is the failing one shrunk (fewer layers, stages,
chunks, rows...) while the same kind of mismatch still fails (``--no-shrink``
shows the original). ``--verbose`` or ``--seed N`` also prints the shrunk
configuration as a standalone Python snippet (it imports :mod:`layers` and
:func:`compare.check`). The last line is ``fuzz: N configurations, M
mismatches (C compared against the boundary-cloned model)`` (M counts
configuration x category); the exit code is 1 when M > 0. The line before
it counts the configurations run again from the same seed (and those whose
dropout drew then, by step, checkpoint mode and with several micro-batches),
the one before it the module configurations (:mod:`modules`, by feature), the
one before that those with skip connections (and those with one
crossing a stage boundary), the one before it those run with each batch dim variant (the Pipe given
``batch_dim`` / ``output_batch_dim``; see ``configs._batch_dims``), and the
one before that those run with train_step, by schedule ('virtual_stages':
more than one stage per device; 'table': a random gpipe.Schedule; see
``configs._train_step``) and those with one checkpoint mode per stage.

Categories: ``exception`` (one side raises and the other does not, or the
types differ), ``output`` (values, shapes, dtypes or tuple structure, or the
caller's inputs left otherwise after forward), ``requires_grad`` (an output's
flag differs), ``grad`` (an input grad, a returned grad or a ``.grad`` differs
or is missing), ``side-effect`` (a ``.grad`` the reference leaves untouched is
filled or changed: autograd.grad and backward(inputs=...) must touch nothing
else), ``reproducibility`` (the Pipe run again from the same seed gives other
bits: an output, the loss, a returned grad or a ``.grad``; or raises
otherwise), ``hang`` (no answer within ``--timeout`` seconds; the run stops there,
since stuck threads may hold locks), ``harness`` (the fuzzer itself failed: a
bug here, not in gpipe).
"""
import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the fuzzer's modules: layers, reference, compare, configs
    sys.path.insert(0, HERE)

from compare import CATEGORIES, Hang, check, run_config  # noqa: E402,F401 - check: re-exported
from configs import BATCH_DIM_ODDS, MODES, SCHEDULES, STEP_KINDS, generate, shrink  # noqa: E402
from layers import *  # noqa: E402,F401,F403 - re-exported for older reproductions

#: What the last lines count of the module configurations (see :class:`Summary`).
PIPELINE_COUNTED = ("pipeline", "edge-crossing", "tie-crossing", "shared-kwarg", "tuple-output",
                    "dict-output", "train_step")


@dataclass
class Summary:
    configurations: int = 0
    skipped: int = 0
    mismatches: int = 0
    #: Configurations compared against the boundary-cloned model (see compare.py), not waived.
    cloned: int = 0
    by_category: Dict[str, int] = field(default_factory=dict)
    #: Configurations run with each batch dim variant (see configs.BATCH_DIM_ODDS).
    batch_dims: Dict[str, int] = field(default_factory=dict)
    #: Configurations run with train_step, by schedule (and 'virtual_stages').
    steps: Dict[str, int] = field(default_factory=dict)
    #: Configurations with skip connections, and those with one crossing a stage boundary.
    skips: int = 0
    skips_crossing: int = 0
    #: Module configurations run through gpipe.pipeline (modules.py), by feature: 'pipeline'
    #: (all of them), 'edge-crossing', 'tie-crossing', 'shared-kwarg', 'train_step' ...
    pipelines: Dict[str, int] = field(default_factory=dict)
    #: Configurations whose Pipe run was repeated from the same seed (compare._repeat), and
    #: those whose dropout drew random numbers then: 'drawing', and by step ('drop-in' or the
    #: schedule), checkpoint mode and 'micro-batches' (more than one).
    repeated: int = 0
    drawing: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def run(seeds: Iterable[int], *, only: Sequence[str] = (), skip: Sequence[str] = (),
        without: Sequence[str] = (), needs: Sequence[str] = (), do_shrink: bool = True,
        verbose: bool = False, snippets: bool = False, timeout: float = 60.0,
        write: Callable[[str], None] = print) -> Summary:
    """Fuzzes ``seeds``; writes a line per (configuration, category) mismatch; returns counts."""
    summary = Summary()
    started = time.perf_counter()
    for seed in seeds:
        cfg = generate(seed)
        if set(without) & set(cfg.features) or not set(needs) <= set(cfg.features):
            summary.skipped += 1
            continue
        summary.configurations += 1
        for variant in ("batch_dim",) + tuple(BATCH_DIM_ODDS):
            if variant in cfg.features:
                summary.batch_dims[variant] = summary.batch_dims.get(variant, 0) + 1
        for variant in ("train_step",) + STEP_KINDS + ("virtual_stages", "stage-modes"):
            if variant in cfg.features:
                summary.steps[variant] = summary.steps.get(variant, 0) + 1
        summary.skips += "skips" in cfg.features
        if "pipeline" in cfg.features:
            for v in PIPELINE_COUNTED:
                if v in cfg.features:
                    summary.pipelines[v] = summary.pipelines.get(v, 0) + 1
        summary.skips_crossing += "skip-crossing" in cfg.features
        if verbose:
            write(f"seed {seed}: {cfg.summary()}")
        try:
            found = run_config(cfg, timeout)
        except Hang as e:
            write(f"seed {seed} [hang] {e} | {cfg.summary()}")
            summary.mismatches += 1
            summary.by_category["hang"] = summary.by_category.get("hang", 0) + 1
            write("fuzz: stopping: the hung threads may hold locks the next configurations need")
            break
        if found.repeated:
            summary.repeated += 1
        if found.drew:
            mode = ("per-stage" if getattr(cfg, "stage_modes", False)
                    or not isinstance(cfg.checkpoint, str) else cfg.checkpoint)
            for v in ("drawing", cfg.step or "drop-in", mode) + (
                    ("micro-batches",) if min(cfg.chunks, cfg.rows) > 1 else ()):
                summary.drawing[v] = summary.drawing.get(v, 0) + 1
        if found.reference:
            summary.cloned += 1
            if verbose:
                write(f"seed {seed}: compared against the boundary-cloned model (the plain "
                      f"model refused an in-place operation in {found.reference})")
        found = [m for m in found if (not only or any(m.kind.startswith(o) for o in only))
                 and not any(m.kind.startswith(o) for o in skip)]
        for category in CATEGORIES:
            mine = [m for m in found if m.category == category]
            if not mine:
                continue
            small, first = (shrink(copy.deepcopy(cfg), mine[0], timeout) if do_shrink
                            else (cfg, mine[0]))
            more = f" (+{len(mine) - 1} more)" if len(mine) > 1 else ""
            write(f"seed {seed} [{category}] {first.detail}{more} | {small.summary()}")
            if snippets:
                write(f"--- reproduction (seed {seed}, [{category}]; run from the repository root)")
                write(small.snippet() + "---")
            summary.mismatches += 1
            summary.by_category[category] = summary.by_category.get(category, 0) + 1
    summary.seconds = time.perf_counter() - started
    return summary


def _seed_range(text: str) -> range:
    a, _, b = text.partition(":")
    return range(int(a), int(b)) if b else range(int(a), int(a) + 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=_seed_range, default=range(0, 200),
                        help="A:B runs seeds A..B-1 (default 0:200)")
    parser.add_argument("--seed", type=int, help="one seed; prints its reproduction")
    parser.add_argument("--only-category", default="",
                        help=f"comma-separated categories to report ({', '.join(CATEGORIES)}), "
                             f"or kind prefixes such as exception:backward or "
                             f"exception:forward:pipe=None")
    parser.add_argument("--skip-category", default="",
                        help="comma-separated categories (or kind prefixes) to ignore")
    parser.add_argument("--without", default="",
                        help="skip configurations with any of these features (layer kinds such "
                             "as external, closure, buffer, tied, cond-dropout, dropout, inplace, "
                             "raise, stash, pop, relay; frozen, inplace-first, tuple-input, float32, "
                             "eval, no_grad, pre_grad; backward modes; checkpoint modes; "
                             "train_step, its schedules gpipe, 1f1b, interleaved_1f1b, zb_h1, "
                             "virtual_stages; skips, skip-crossing, skip-namespace, skip-none; "
                             "tie-crossing; pipeline: the module configurations, and their "
                             "edge-crossing, shared-kwarg, tuple-output, dict-output, "
                             "split-inside...: see modules.module_features)")
    parser.add_argument("--with", dest="needs", default="",
                        help="run only configurations with all of these features (as --without "
                             "names them), e.g. train_step or zb_h1")
    parser.add_argument("--no-shrink", action="store_true", help="report configurations as drawn")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per configuration")
    parser.add_argument("--verbose", action="store_true",
                        help="print every configuration and a runnable snippet per mismatch")
    args = parser.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    unknown = {c.split(":")[0] for c in split(args.only_category) + split(args.skip_category)}
    unknown -= set(CATEGORIES)
    if unknown:
        parser.error(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    seeds = range(args.seed, args.seed + 1) if args.seed is not None else args.seeds
    if args.seed is not None:
        print(f"seed {args.seed}: {generate(args.seed).summary()}")
    summary = run(seeds, only=split(args.only_category), skip=split(args.skip_category),
                  without=split(args.without), needs=split(args.needs),
                  do_shrink=not args.no_shrink,
                  verbose=args.verbose, snippets=args.verbose or args.seed is not None,
                  timeout=args.timeout, write=lambda line: print(line, flush=True))
    if args.seed is not None and not summary.mismatches:
        print(f"--- seed {args.seed} as a snippet\n{generate(args.seed).snippet()}---")
    counts = ", ".join(f"{c} {summary.by_category[c]}" for c in CATEGORIES
                       if c in summary.by_category)
    print(f"fuzz: by category: {counts or 'none'}; {summary.skipped} skipped by --without/--with; "
          f"{summary.seconds:.1f} s")
    steps = ", ".join(f"{v} {summary.steps[v]}" for v in ("train_step",) + STEP_KINDS
                      + ("virtual_stages", "stage-modes") if v in summary.steps)
    print(f"fuzz: train_step: {steps or 'none'} (configurations; the rest ran forward and "
          f"backward; 'stage-modes': one checkpoint mode per stage, with or without train_step)")
    variants = ", ".join(f"{v} {n}" for v, n in summary.batch_dims.items())
    print(f"fuzz: batch dims: {variants or 'none'} (configurations; 'batch_dim': the Pipe got "
          f"batch_dim or output_batch_dim)")
    print(f"fuzz: skips: {summary.skips} configurations ({summary.skips_crossing} crossing stages)")
    counted = ", ".join(f"{v} {summary.pipelines[v]}" for v in PIPELINE_COUNTED[1:]
                        if v in summary.pipelines)
    print(f"fuzz: pipeline: {summary.pipelines.get('pipeline', 0)} module configurations "
          f"through gpipe.pipeline ({counted or 'none'})")
    drawn = ", ".join(f"{v} {summary.drawing[v]}" for v in ("drop-in",) + STEP_KINDS + MODES
                      + ("per-stage", "micro-batches") if v in summary.drawing)
    print(f"fuzz: reproducibility: {summary.repeated} configurations run again from the same "
          f"seed, {summary.drawing.get('drawing', 0)} drawing random numbers "
          f"({drawn or 'none'})")
    print(f"fuzz: {summary.configurations} configurations, {summary.mismatches} mismatches "
          f"({summary.cloned} compared against the boundary-cloned model)")
    if "hang" in summary.by_category:
        # Threads stuck in the engine could block interpreter shutdown (joins in destructors).
        sys.stdout.flush()
        os._exit(1)
    return 1 if summary.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
