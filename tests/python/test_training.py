"""A real training run: the digits MLP over 3 CPU stages reaches 95% and matches the plain model."""
import importlib.util
from pathlib import Path
from typing import List

import pytest

import sklearn  # noqa: F401  (the digits data set; pip install scikit-learn)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.fixture(scope="module")
def trained(example):
    """Both runs of the example, trained once for every test here."""
    lines: List[str] = []
    pipelined, reference = example.compare(log=lines.append)
    return pipelined, reference, lines


def test_pipelined_model_learns(trained, example):
    pipelined, _, _ = trained
    assert len(pipelined.losses) == example.EPOCHS
    assert pipelined.accuracy >= 0.95, f"test accuracy {pipelined.accuracy:.4f}"
    assert pipelined.losses[-1] < 0.25 * pipelined.losses[0], pipelined.losses


def test_pipelined_matches_plain(trained):
    pipelined, reference, _ = trained
    assert reference.accuracy >= 0.95, f"the plain model itself reaches {reference.accuracy:.4f}"
    assert abs(pipelined.accuracy - reference.accuracy) <= 0.02
    # Transparent up to float32 summation order: the curves track each other.
    for epoch, (a, b) in enumerate(zip(pipelined.losses, reference.losses)):
        assert abs(a - b) <= 1e-2 * max(b, 1e-3) + 1e-4, f"epoch {epoch}: loss {a} vs {b}"


def test_example_is_pipelined(example):
    assert example.BALANCE == [2, 2, 1] and example.CHUNKS == 4
    pipe = example.gpipe.Pipe(example.make_model(), balance=example.BALANCE,
                              chunks=example.CHUNKS)
    assert len(pipe.balance) == 3 and pipe.chunks == 4


def test_progress_is_printed_per_epoch(trained, example):
    _, _, lines = trained
    per_epoch = [line for line in lines if "pipelined" in line and "epoch" in line]
    assert len(per_epoch) == example.EPOCHS
    assert all("loss" in line and "test accuracy" in line for line in per_epoch)


def test_verdict_ok_and_exit_code(trained, example):
    pipelined, reference, _ = trained
    lines: List[str] = []
    assert example.verdict(pipelined, reference, log=lines.append) == 0
    assert lines[-1] == "OK"


def test_verdict_fails_loudly(trained, example):
    """The example's check can fail: a worse pipelined run makes it exit 1."""
    pipelined, reference, _ = trained
    worse = example.Run("pipelined", losses=[1.0], accuracies=[reference.accuracy - 0.05])
    lines: List[str] = []
    assert example.verdict(worse, reference, log=lines.append) == 1
    assert lines[-1].startswith("FAILED")


def test_speed_is_reported_and_a_slower_pipeline_explained(example):
    plain = example.Run("plain", accuracies=[0.97], seconds=1.0, steps=100)
    slower = example.Run("pipelined", accuracies=[0.97], seconds=3.0, steps=100)
    lines: List[str] = []
    example.explain_speed(slower, plain, log=lines.append)
    assert lines[0] == "speed: pipelined 30.00 ms per step, plain 10.00 ms per step"
    assert lines[1].startswith("why the pipelined run is 3.0x slower") and "per cell" in lines[1]
    faster = example.Run("pipelined", accuracies=[0.97], seconds=0.5, steps=100)
    lines = []
    example.explain_speed(faster, plain, log=lines.append)
    assert lines == ["speed: pipelined 5.00 ms per step, plain 10.00 ms per step"]


def test_main_wires_compare_to_verdict(trained, example, monkeypatch, tmp_path):
    """main() as the script runs it, reusing the runs above instead of training again;
    it draws the timeline of a traced step."""
    pipelined, reference, _ = trained
    monkeypatch.setattr(example, "compare", lambda epochs, log: (pipelined, reference))
    lines: List[str] = []
    timeline = tmp_path / "timeline.png"
    assert example.main(log=lines.append, timeline=str(timeline)) == 0
    assert "OK" in lines
    assert timeline.read_bytes()[:4] == b"\x89PNG"
    assert any(line.startswith("one traced step:") and "bubble" in line for line in lines)


SCHEDULES_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "schedules.py"


def test_schedules_example_matches_the_plain_model():
    """examples/schedules.py: every schedule's step equals the plain model's (its timing is
    the example's business, not a test's)."""
    spec = importlib.util.spec_from_file_location("schedules", SCHEDULES_EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for schedule in module.SCHEDULES:
        result = module.one_step(schedule, 0.0005, None)
        assert result["error"] <= 1e-10, (schedule, result)


UNET_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_unet.py"


def load_unet_example():
    spec = importlib.util.spec_from_file_location("train_unet", UNET_EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unet_example_checks_itself_and_draws_its_timeline(tmp_path):
    """examples/train_unet.py as the script runs it: skips across stages, the float64 step
    equal to the plain model's, the loss falling, the timeline drawn."""
    example = load_unet_example()
    lines: List[str] = []
    timeline = tmp_path / "timeline_unet.png"
    assert example.main(["--timeline", str(timeline)], log=lines.append) == 0, "\n".join(lines)
    assert lines[-1] == "OK"
    assert any(line.startswith("check 1:") for line in lines)
    assert any(line.startswith("check 2:") for line in lines)
    assert timeline.read_bytes()[:4] == b"\x89PNG"
    # The skips do cross stages under the example's balance.
    pipe = example.make_pipe(example.make_model())
    routes = example.gpipe.skip.layout.skip_routes(pipe._partitions())
    assert sorted((r.stash_stage, r.pop_stage) for r in routes) == [(0, 3), (1, 2)]


def test_unet_example_fails_loudly():
    example = load_unet_example()
    good = example.Run(losses=[0.2] * 5 + [0.02] * 5, seconds=1.0, black=0.15)
    lines: List[str] = []
    assert example.verdict(0.0, good, log=lines.append) == 0 and lines[-1] == "OK"
    for error, run in ((1e-6, good),
                       (0.0, good._replace(losses=[0.2] * 5 + [0.15] * 5)),
                       (0.0, good._replace(black=0.03))):
        lines = []
        assert example.verdict(error, run, log=lines.append) == 1
        assert lines[-1].startswith("FAILED")
