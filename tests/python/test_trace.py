"""Tracing from Python: gpipe.tracing, Pipe(trace=True), Chrome JSON, the summary and plot_timeline."""
import json

import pytest
import torch
from torch import nn

import gpipe
from conftest import Sleep


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def test_tracing_is_off_by_default():
    pipe = gpipe.Pipe(_model(), balance=[2, 1], chunks=2)
    assert not pipe.tracing
    pipe(torch.randn(4, 4)).sum().backward()
    assert len(pipe.trace) == 0


def test_tracing_context_records_every_cell_in_order():
    pipe = gpipe.Pipe(_model(), balance=[2, 1], chunks=3, checkpoint="always")
    with gpipe.tracing(pipe) as trace:
        pipe(torch.randn(6, 4)).sum().backward()
    assert not pipe.tracing  # switched back
    events = trace.events
    phases = [e.phase for e in events]
    assert phases.count("forward") == 2 * 3
    assert phases.count("recompute") == 2 * 3
    assert phases.count("backward") == 2 * 3
    assert "copy" not in phases
    for stage in range(2):
        mine = sorted((e for e in events if e.stage == stage), key=lambda e: e.start_us)
        order = [e.phase[0].upper() + str(e.microbatch) for e in mine]
        assert order == ["F0", "F1", "F2", "R2", "B2", "R1", "B1", "R0", "B0"]
        assert len({e.thread for e in mine if e.phase == "forward"}) == 1
    assert all(e.step == 0 and e.end_us >= e.start_us for e in events)
    # A second block starts afresh.
    with gpipe.tracing(pipe) as again:
        pipe(torch.randn(6, 4))
    assert [e.phase for e in again.events] == ["forward"] * 6


def test_pipe_trace_argument_and_chrome_json(tmp_path):
    pipe = gpipe.Pipe(_model(), balance=[1, 2], chunks=2, checkpoint="never", trace=True)
    for _ in range(2):
        pipe(torch.randn(4, 4)).sum().backward()
    trace = pipe.trace
    assert {e.step for e in trace.events} == {0, 1}
    path = tmp_path / "trace.json"
    trace.save_chrome_json(str(path))
    data = json.loads(path.read_text())
    boxes = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len(trace.events) == 2 * 2 * 2 * 2
    assert {e["tid"] for e in boxes} == {0, 1}
    assert {e["name"] for e in boxes} == {"F0", "F1", "B0", "B1"}
    names = [e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["stage 0", "stage 1"]
    pipe.clear_trace()
    assert len(pipe.trace) == 0
    with pytest.raises(RuntimeError, match="no-such-dir"):
        trace.save_chrome_json(str(tmp_path / "no-such-dir" / "t.json"))


def test_summary_of_sleeping_stages():
    stages, chunks = 3, 4
    model = nn.Sequential(*[Sleep(0.01) for _ in range(stages)])
    pipe = gpipe.Pipe(model, balance=[1] * stages, chunks=chunks, checkpoint="never")
    with gpipe.tracing(pipe) as trace:
        pipe(torch.randn(8, 2)).sum().backward()
    s = trace.summary()
    assert (s.stages, s.microbatches, s.steps) == (stages, chunks, 1)
    assert s.ideal_bubble == pytest.approx((stages - 1) / (chunks + stages - 1))
    assert len(s.busy_us) == stages
    assert all(b >= chunks * 10_000 * 0.95 for b in s.busy_us)  # forward sleeps alone
    assert s.ideal_bubble - 0.05 < s.bubble < s.ideal_bubble + 0.3
    assert "bubble" in str(s) and "stage 2: busy" in str(s)


def test_plot_timeline_writes_a_png(tmp_path):
    pipe = gpipe.Pipe(_model(), balance=[2, 1], chunks=4)
    with gpipe.tracing(pipe) as trace:
        pipe(torch.randn(8, 4)).sum().backward()
    path = tmp_path / "timeline.png"
    gpipe.plot_timeline(trace, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
    with pytest.raises(ValueError, match="empty"):
        gpipe.plot_timeline(gpipe.Trace(), tmp_path / "empty.png")


# -- a bounded trace ----------------------------------------------------------

def test_trace_keeps_the_newest_whole_steps_within_its_capacity():
    # 2 stages x 2 micro-batches x (forward, backward): 8 events per step.
    per_step, steps = 8, 40
    pipe = gpipe.Pipe(_model(), balance=[2, 1], chunks=2, checkpoint="never", trace=True)
    assert pipe.trace_capacity == gpipe.trace.DEFAULT_TRACE_CAPACITY == 100_000
    pipe.trace_capacity = 20
    assert pipe.trace_capacity == 20
    for _ in range(steps):
        pipe(torch.randn(4, 4)).sum().backward()
    trace = pipe.trace
    assert len(trace) == 2 * per_step  # the newest whole steps that fit in 20
    assert trace.dropped == (steps - 2) * per_step
    assert {e.step for e in trace.events} == {steps - 2, steps - 1}
    assert trace.summary().steps == 2
    # Lowering the capacity trims at once (a step alone over it: its newest events).
    pipe.trace_capacity = 5
    trace = pipe.trace
    assert len(trace) == 5 and {e.step for e in trace.events} == {steps - 1}
    assert trace.dropped == steps * per_step - 5
    with pytest.raises(ValueError, match="at least 1 event, got 0"):
        pipe.trace_capacity = 0
    pipe.clear_trace()
    assert len(pipe.trace) == 0 and pipe.trace.dropped == 0


def test_tracing_context_reports_what_it_dropped():
    pipe = gpipe.Pipe(_model(), balance=[2, 1], chunks=2, checkpoint="never")
    pipe.trace_capacity = 8
    with gpipe.tracing(pipe) as trace:
        for _ in range(3):
            pipe(torch.randn(4, 4)).sum().backward()
    assert len(trace) == 8 and trace.dropped == 16
    assert {e.step for e in trace.events} == {2}


def test_trace_types_are_exported_and_documented():
    pipe = gpipe.Pipe(_model(), balance=[2, 1], chunks=2)
    with gpipe.tracing(pipe) as trace:
        pipe(torch.randn(4, 4)).sum().backward()
    assert isinstance(trace, gpipe.Trace)
    assert all(isinstance(e, gpipe.TraceEvent) for e in trace.events)
    assert isinstance(trace.summary(), gpipe.TraceSummary)
    for name in ("Trace", "TraceEvent", "TraceSummary"):
        assert name in gpipe.__all__ and name in gpipe.trace.__all__
    assert "microseconds" in gpipe.TraceEvent.start_us.__doc__
    assert "(K-1)/(M+K-1)" in gpipe.TraceSummary.ideal_bubble.__doc__
    assert "1 - sum(busy_us) / (stages * span_us)" in gpipe.TraceSummary.bubble.__doc__
    for field in ("step", "stage", "microbatch", "phase", "start_us", "end_us", "thread"):
        assert getattr(gpipe.TraceEvent, field).__doc__, field
    for field in ("stages", "microbatches", "steps", "busy_us", "span_us", "bubble",
                  "ideal_bubble"):
        assert getattr(gpipe.TraceSummary, field).__doc__, field
