"""README.md's code runs as written: every ```python block here, every complete ```cpp program under ctest.

Each ```python block runs as a script of its own (in one fresh interpreter,
this one's, with this environment, in an empty folder): it must be
self-contained. A ```cpp
block holding ``int main(`` is a complete program: cmake/GPipeReadme.cmake
builds and runs it as the ctest test readme_<n>, by the same rule as
``_programs`` below. Blocks tagged sh or cmake, untagged ones (output,
listings) and ```cpp fragments are not run; any other tag fails here, so a
block cannot dodge both runners by its spelling (```py, ```c++, ```bash).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: Fence tags this test (python) or CMake (cpp) knows what to do with.
KNOWN_TAGS = {"python", "cpp", "sh", "cmake", ""}

#: Seconds a block may take: a short training loop, imports on a loaded machine.
TIMEOUT = 120

#: What makes a ```cpp block a complete program (the same regex as cmake/GPipeReadme.cmake).
_MAIN = re.compile(r"int[ \t]+main[ \t]*\(")


class Block(NamedTuple):
    tag: str
    line: int  # of the opening fence, 1-based
    text: str


def _blocks() -> List[Block]:
    """The fenced blocks of README.md, in order."""
    blocks: List[Block] = []
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            # Not stripped: "```cpp " would escape CMake's "```cpp\n" search.
            tag, start = lines[i][3:], i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            assert i < len(lines), f"README.md:{start + 1}: a ``` fence is never closed"
            blocks.append(Block(tag, start + 1, "\n".join(lines[start + 1:i]) + "\n"))
        i += 1
    return blocks


def _python_blocks() -> List[Block]:
    return [b for b in _blocks() if b.tag == "python"]


def _programs() -> List[Block]:
    """The complete C++ programs, in order: readme_1, readme_2, ... under ctest."""
    return [b for b in _blocks() if b.tag == "cpp" and _MAIN.search(b.text)]


def test_every_block_has_a_tag_a_runner_knows() -> None:
    unknown = [f"README.md:{b.line}: ```{b.tag}" for b in _blocks() if b.tag not in KNOWN_TAGS]
    assert not unknown, (
        f"{unknown}: tag code as python (run by tests/python/test_readme.py), cpp (complete "
        f"programs run by ctest, see cmake/GPipeReadme.cmake), sh or cmake (not run), or leave "
        f"output untagged")


def test_readme_has_python_blocks_and_a_cpp_program() -> None:
    # Guards the extraction itself: a broken parser would run nothing and pass.
    assert _python_blocks(), "no ```python block found in README.md"
    assert _programs(), "no complete ```cpp program (with int main) found in README.md"


#: Runs the blocks given as JSON [[line, text], ...] one after another, each in
#: a fresh namespace as a script of its own; tracebacks name README.md's lines.
_RUNNER = """
import json, sys, traceback
for line, text in json.loads(sys.argv[1]):
    code = compile("\\n" * line + text, sys.argv[2], "exec")
    try:
        exec(code, {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md:{line}: this ```python block failed")
"""


def test_python_blocks_run(tmp_path: Path) -> None:
    # One interpreter for all blocks (torch is imported once: seconds each),
    # but no block sees another's names.
    blocks = _python_blocks()
    env = dict(os.environ, MPLBACKEND="Agg")
    argv = [sys.executable, "-c", _RUNNER, json.dumps([[b.line, b.text] for b in blocks]),
            str(README)]
    try:
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md's ```python blocks (lines {[b.line for b in blocks]}) ran over "
                    f"{TIMEOUT} s")
    assert proc.returncode == 0, (
        f"a README.md ```python block failed; each must run on its own, as written "
        f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def _cmake_build_dir() -> Path:
    return Path(os.environ.get("GPIPE_CMAKE_BUILD_DIR") or ROOT / "build")


def test_cpp_programs_are_the_ones_ctest_runs() -> None:
    # The C++ side extracts the programs with CMake; this checks that it
    # found the same ones (so neither rule drifts), where a build is around.
    extracted = _cmake_build_dir() / "readme"
    if not extracted.is_dir():
        pytest.skip(f"no {extracted}: configure gpipe with GPIPE_BUILD_EXAMPLES (scripts/build.sh) "
                    f"or point GPIPE_CMAKE_BUILD_DIR at such a build")
    programs = _programs()
    for n, block in enumerate(programs, start=1):
        source = extracted / f"readme_{n}.cpp"
        assert source.is_file(), (f"README.md:{block.line}: no {source}; reconfigure the build "
                                  f"(cmake/GPipeReadme.cmake extracts the programs)")
        assert source.read_text() == block.text, (
            f"{source} is not README.md:{block.line}'s program: reconfigure the build, or make "
            f"cmake/GPipeReadme.cmake and this test extract blocks alike")
    stale = sorted(p.name for p in extracted.glob("readme_*.cpp")
                   if int(re.sub(r"\D", "", p.stem)) > len(programs))
    assert not stale, f"{extracted} holds {stale} beyond README.md's {len(programs)} programs"
