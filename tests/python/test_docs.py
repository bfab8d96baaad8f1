"""The API reference (docs/api/) is complete and current: `python3 docs/api/build.py --check` passes."""
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import gpipe  # noqa: F401  (the generator documents the gpipe these tests import)

ROOT = Path(__file__).resolve().parents[2]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpipe_docs_build", ROOT / "docs" / "api" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_complete_and_current(capsys: pytest.CaptureFixture[str]) -> None:
    status = load_generator().main(["--check"])
    out = capsys.readouterr().out
    assert status == 0, ("docs/api is incomplete or stale: document what the warnings name "
                         f"(docstrings, /// comments), then run `python3 docs/api/build.py`:\n{out}")


def test_check_fails_on_stale_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The check can fail: with no committed output next to it, both files are stale.
    build = load_generator()
    build.OUT = tmp_path
    assert build.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "python.md is stale" in out and "cpp.md is stale" in out
    assert not list(tmp_path.iterdir())  # --check writes nothing
