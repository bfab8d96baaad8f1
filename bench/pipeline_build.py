"""bench/pipeline_build.py — how long gpipe.pipeline takes to build a Hugging Face causal LM, where that time goes, and the first steps.

    python bench/pipeline_build.py                 # in process: phases, build, first steps
    python bench/pipeline_build.py --ranks 4       # gpipe.distributed.pipeline on 4 Gloo ranks
    python bench/pipeline_build.py --tracer export --split model.layers.1,model.layers.3

The model is a tiny random LlamaForCausalLM (hidden 64, 4 layers, vocab 256, tied head,
float64, eval mode: about 200k parameters), built from its config (no download). In process,
the build is timed whole (the first in the process, then again), and once more by phase
(the hooked run of stages=K, the fx attempt, torch.export.export, ExportedProgram.module(),
recording the example's values, making the stages, the Pipe); then the first two train_steps
are timed. Over ranks, each rank times its own build and first steps, and rank 0 prints them.
Prints one line per figure; nothing is checked (tests/python/test_pipeline_hf.py checks).
"""
import argparse
import contextlib
import cProfile
import functools
import gc
import importlib
import os
import pstats
import socket
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F

#: Phases by the function that runs them: (label, its module, its name). Each is timed by a
#: wrapper put where the build looks it up, for the build (perf_counter; cProfile would double
#: Python's share). A function a version lacks is left out.
PHASES = [
    ("split points (stages=K: one hooked run)", "gpipe.pipeline", "balanced_split_points"),
    ("torch.fx attempt (tracer='auto')", "gpipe._pipeline_trace", "_fx"),
    ("torch.export.export", "torch.export", "export"),
    ("ExportedProgram.module()", "torch.export.exported_program", "ExportedProgram.module"),
    ("recording the example's values", "gpipe.pipeline", "_record_values"),
    ("making the stages", "gpipe.pipeline", "_stage"),
    ("the Pipe itself", "gpipe.pipe", "Pipe.__init__"),
    ("the Pipe itself (over ranks)", "gpipe.distributed", "Pipe.__init__"),
]


@contextlib.contextmanager
def timed_phases(totals: Dict[str, float]) -> Iterator[None]:
    """Meanwhile each phase's function adds its time to ``totals[label]``."""
    undo = []
    for label, module_name, name in PHASES:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None:
            continue
        totals[label] = 0.0

        def wrapper(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
            begin = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] += time.perf_counter() - begin

        setattr(owner, attr, functools.wraps(fn)(wrapper))
        undo.append((owner, attr, fn))
    # Python's garbage collector, wherever it runs (its pauses fall in any phase).
    totals["(of which the garbage collector)"] = 0.0
    started = [0.0]

    def collector(phase: str, info: Dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            totals["(of which the garbage collector)"] += time.perf_counter() - started[0]

    gc.callbacks.append(collector)
    try:
        yield
    finally:
        gc.callbacks.remove(collector)
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)


def llama() -> torch.nn.Module:
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def loss_fn(out, tgt):
    return F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), tgt.reshape(-1))


def options(args: argparse.Namespace) -> Dict:
    kw: Dict = {"chunks": 4}
    if args.tracer:
        kw["tracer"] = args.tracer
    if args.split:
        kw["split_points"] = args.split.split(",")
    elif not args.ranks:
        kw["stages"] = args.stages
    return kw


def in_process(args: argparse.Namespace) -> None:
    import gpipe
    model = llama()
    print(f"LlamaForCausalLM, {sum(p.numel() for p in model.parameters())} parameters; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread")
    ids = torch.randint(0, 256, (8, 16))
    builds = []
    for _ in range(2):  # the first in the process (cold: torch.export's first use), then warm
        begin = time.perf_counter()
        pipe = gpipe.pipeline(model, example_args=(ids,), **options(args))
        builds.append(time.perf_counter() - begin)
    print(f"build {builds[0]:.3f} s cold, {builds[1]:.3f} s warm (tracer "
          f"{getattr(pipe, 'tracer', args.tracer)}, split points "
          f"{getattr(pipe, 'split_points', args.split)})")
    totals: Dict[str, float] = {}
    with timed_phases(totals):
        begin = time.perf_counter()
        gpipe.pipeline(model, example_args=(ids,), **options(args))
        total = time.perf_counter() - begin
    collected = totals.pop("(of which the garbage collector)")
    print(f"a warm build again, {total:.3f} s, by phase:")
    for label, seconds in totals.items():
        if seconds:  # (0.0: never called)
            print(f"  {label:42s} {seconds:7.3f} s")
    print(f"  {'the rest (the cut: routes, state keys...)':42s} "
          f"{total - sum(totals.values()):7.3f} s")
    print(f"  {'(in all these, the garbage collector)':42s} {collected:7.3f} s")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        gpipe.pipeline(model, example_args=(ids,), **options(args))
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
    pipe.eval()  # the module's mode (an exported graph runs in it only)
    for step in ("first", "second"):
        begin = time.perf_counter()
        pipe.train_step((ids,), ids, loss_fn)
        print(f"{step} train_step {time.perf_counter() - begin:.3f} s")


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import gpipe.distributed
    dist.init_process_group("gloo")
    model = llama()
    ids = torch.randint(0, 256, (8, 16))
    dist.barrier()
    totals: Dict[str, float] = {}
    with timed_phases(totals):
        begin = time.perf_counter()
        pipe = gpipe.distributed.pipeline(model, example_args=(ids,), schedule=args.schedule,
                                          **options(args))
        build = time.perf_counter() - begin
    phases = ", ".join(f"{label} {seconds:.3f}" for label, seconds in totals.items() if seconds)
    phases = phases.replace("(of which the garbage collector)", "of all that, the garbage collector")
    pipe.eval()  # the module's mode (an exported graph runs in it only)
    steps = []
    for _ in range(2):
        begin = time.perf_counter()
        pipe.train_step((ids,) if pipe.is_first else None, ids if pipe.is_last else None,
                        loss_fn=loss_fn)
        steps.append(time.perf_counter() - begin)
    found: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(found, f"rank {dist.get_rank()}: build {build:.3f} s, first "
                                  f"train_step {steps[0]:.3f} s, second {steps[1]:.3f} s "
                                  f"(tracer {getattr(pipe, 'tracer', args.tracer)}, split points "
                                  f"{getattr(pipe, 'split_points', args.split)}); {phases}")
    if dist.get_rank() == 0:
        print("\n".join(str(f) for f in found))
    dist.destroy_process_group()


def spawn(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"gpipe.distributed.pipeline on {args.ranks} Gloo ranks ({args.schedule}), "
          f"{os.cpu_count()} CPUs, 1 thread each")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(args.ranks)]
                              + sys.argv[1:],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       OMP_NUM_THREADS="1"))
             for r in range(args.ranks)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"ranks exited with {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=0, help="Gloo ranks (0: in process)")
    parser.add_argument("--schedule", default="1f1b", help="over ranks: the schedule")
    parser.add_argument("--stages", type=int, default=4, help="in process: stages=K")
    parser.add_argument("--split", default="", help="split points, comma-separated")
    parser.add_argument("--tracer", default="", help="fx, export or auto (default: pipeline's)")
    parser.add_argument("--profile", type=int, default=0,
                        help="in process: also print cProfile's top N by cumulative time")
    parser.add_argument("--rank-of", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rank_of:
        rank_main(args)
    elif args.ranks:
        spawn(args)
    else:
        in_process(args)


if __name__ == "__main__":
    main()
