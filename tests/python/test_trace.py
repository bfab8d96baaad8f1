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
