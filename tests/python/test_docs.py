"""The API reference (docs/api/) is complete and up to date: docs/api/build.py --check passes."""
import os
import subprocess
import sys
from pathlib import Path

import gpipe

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "docs" / "api" / "build.py"


def test_api_reference_is_complete_and_current() -> None:
    # The generator imports the gpipe this test runs against (same interpreter,
    # same sys.path), so it documents what the other tests test.
    env = dict(os.environ)
    package = str(Path(gpipe.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, str(BUILD), "--check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        "docs/api is incomplete or stale; document what the warnings name, then run "
        f"`python3 docs/api/build.py`:\n{result.stdout}{result.stderr}")


def test_check_fails_on_stale_output(tmp_path: Path) -> None:
    # The check must be able to fail: a copy of the generator whose committed
    # output is missing reports it as stale.
    api = tmp_path / "docs" / "api"
    api.mkdir(parents=True)
    (api / "build.py").write_text(BUILD.read_text())
    (tmp_path / "include").symlink_to(ROOT / "include")
    (tmp_path / "python").symlink_to(ROOT / "python")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(gpipe.__file__).resolve().parents[1])] +
        [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, str(api / "build.py"), "--check"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "python.md is stale" in result.stdout and "cpp.md is stale" in result.stdout
