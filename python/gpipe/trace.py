"""Tracing a Pipe: record what each stage ran and when, and draw it as a timeline.

Example::

    with gpipe.tracing(pipe) as trace:
        pipe(x).sum().backward()
    print(trace.summary())                 # measured bubble vs (K-1)/(M+K-1)
    trace.save_chrome_json("trace.json")   # chrome://tracing or ui.perfetto.dev
    gpipe.plot_timeline(trace, "timeline.png")

A trace is bounded: a Pipe keeps the most recent
:attr:`gpipe.Pipe.trace_capacity` events (default :data:`DEFAULT_TRACE_CAPACITY`,
100,000, about 5.6 MB), dropping whole steps, oldest first, so a long run
can stay traced and :meth:`Trace.summary` still measures complete steps;
:attr:`Trace.dropped` counts what was dropped.

:class:`TraceEvent` (one cell or copy) and :class:`TraceSummary` (the
measured bubble) document their fields; times are microseconds of host time
since the Pipe was built.
"""
import contextlib
import os
from typing import TYPE_CHECKING, Dict, Iterator, Union

from gpipe import _C

if TYPE_CHECKING:
    from gpipe.pipe import Pipe

__all__ = ["Trace", "TraceEvent", "TraceSummary", "DEFAULT_TRACE_CAPACITY", "tracing",
           "plot_timeline"]

Trace = _C.Trace
TraceEvent = _C.TraceEvent
TraceSummary = _C.TraceSummary
#: How many of the most recent events a Pipe's trace keeps unless its
#: ``trace_capacity`` is set.
DEFAULT_TRACE_CAPACITY: int = _C.DEFAULT_TRACE_CAPACITY

#: Box colours by phase.
_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#55A868",
            "copy": "#8C8C8C", "loss": "#937860", "input_grad": "#C44E52",
            "weight_grad": "#8172B3", "send": "#CCB974", "receive": "#DADADA"}


@contextlib.contextmanager
def tracing(pipe: "Pipe") -> Iterator[Trace]:
    """Records every cell ``pipe`` runs inside the ``with`` block (forward and
    backward alike) into the yielded :class:`Trace`, filled on exit. Earlier
    recordings are dropped; tracing is switched back to what it was. At most
    ``pipe.trace_capacity`` of the most recent events are kept (whole steps;
    ``trace.dropped`` counts the rest)."""
    was = pipe.tracing
    pipe.clear_trace()
    pipe.tracing = True
    trace = Trace()
    try:
        yield trace
    finally:
        recorded = pipe.trace
        trace.events = recorded.events
        trace.dropped = recorded.dropped
        pipe.tracing = was


def plot_timeline(trace: Trace, path: Union[str, "os.PathLike[str]"], *,
                  title: str = "gpipe timeline", by: str = "stage") -> None:
    """Draws ``trace`` as a Gantt chart to ``path`` (PNG, or any format
    matplotlib infers from the suffix): one row per stage, one box per cell
    labelled with its micro-batch, each phase (forward, backward, recompute,
    copy, and under ``train_step`` loss, input_grad and weight_grad; over a
    process group send and receive) in its own colour, time in milliseconds from the first event. ``by="thread"``
    gives one row per thread instead (a worker, with ``virtual_stages``
    running several stages; boxes then read micro-batch.stage)."""
    if by not in ("stage", "thread"):
        raise ValueError(f"by is 'stage' or 'thread', got {by!r}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - matplotlib is in requirements.txt
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib") from e
    events = list(trace.events)
    if not events:
        raise ValueError("the trace is empty: turn tracing on (gpipe.tracing(pipe) or "
                         "Pipe(..., trace=True)) and run the Pipe before plotting")
    origin = min(e.start_us for e in events)
    if by == "stage":
        rows = {j: j for j in range(max(e.stage for e in events) + 1)}
        names = [f"stage {j}" for j in rows]
        row_of = lambda e: e.stage  # noqa: E731
    else:
        # Threads in the order of the lowest stage each ran.
        first: Dict[int, int] = {}
        for e in events:
            first[e.thread] = min(first.get(e.thread, e.stage), e.stage)
        order = sorted(first, key=lambda t: (first[t], t))
        rows = {t: k for k, t in enumerate(order)}
        names = [f"worker {k}" for k in range(len(order))]
        row_of = lambda e: rows[e.thread]  # noqa: E731
    span = max((e.end_us - origin) / 1000.0 for e in events)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for e in events:
        start = (e.start_us - origin) / 1000.0
        width = max((e.end_us - e.start_us) / 1000.0, 1e-6)
        row = row_of(e)
        ax.broken_barh([(start, width)], (row - 0.4, 0.8),
                       facecolors=_COLOURS[e.phase], edgecolors="white", linewidth=0.5)
        label = str(e.microbatch) if by == "stage" else f"{e.microbatch}.{e.stage}"
        if width < 0.012 * span:
            continue  # too narrow to read (a loss, an empty I)
        ax.text(start + width / 2, row, label, ha="center", va="center",
                fontsize=6 if by == "thread" else 7, color="white", clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    summary = trace.summary()
    ax.set_title(f"{title}: bubble {summary.bubble:.2f} (GPipe's ideal "
                 f"{summary.ideal_bubble:.2f})")
    present = sorted({e.phase for e in events}, key=list(_COLOURS).index)
    ax.legend(handles=[Patch(color=_COLOURS[p], label=p) for p in present],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
