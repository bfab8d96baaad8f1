# report.py — the GPU kit's report: the machine's facts, suite counts and BENCH lines from run.sh's logs.
"""Helper of tests/gpu/run.sh (not a test itself).

    python3 tests/gpu/report.py env            prints the machine's facts as JSON
    python3 tests/gpu/report.py write LOGS OUT  writes the Markdown report OUT from LOGS

LOGS holds what run.sh leaves: env.json, steps.tsv (one line per step:
name, outcome, exit status, seconds, required or optional) and <step>.log.
Nothing here imports gpipe, so a report is written whatever failed.
"""
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

# The steps whose logs are test suites, and how each is read.
SUITES = [
    ("catch2-cuda", "Catch2 `[cuda]` (tests/cpp/test_cuda.cpp)", "catch2"),
    ("pytest-cuda", "pytest tests/python/test_cuda.py", "pytest"),
    ("catch2-cpu", "Catch2, everything else (`~[cuda]`)", "catch2"),
    ("pytest-rest", "pytest tests/python, everything else", "pytest"),
]
# What a C++ CUDA case prints (a Catch2 WARN) when it skips for want of devices.
SKIP_TEXTS = ("skipped: no CUDA device", "skipped: fewer than 2 CUDA devices")


def command_output(args: List[str]) -> Optional[str]:
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip()
    return text if out.returncode == 0 and text else None


def env() -> Dict[str, object]:
    """What the report says about the machine; never raises."""
    facts: Dict[str, object] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import torch
        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
        facts["cuda_available"] = bool(torch.cuda.is_available())
        if facts["cuda_available"]:
            facts["device_count"] = torch.cuda.device_count()
            facts["device"] = torch.cuda.get_device_name(0)
            props = torch.cuda.get_device_properties(0)
            facts["device_memory_gib"] = round(props.total_memory / 2**30, 1)
            facts["capability"] = f"{props.major}.{props.minor}"
    except Exception as e:  # noqa: BLE001 - a broken torch is itself a fact to report
        facts["torch_error"] = f"{type(e).__name__}: {e}"
    for name, args in [("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                       "--format=csv,noheader"]),
                       ("cmake", ["cmake", "--version"]), ("ninja", ["ninja", "--version"]),
                       ("nvcc", ["nvcc", "--version"]),
                       # The compiler the kit chose (compiler.sh exports CXX).
                       ("cxx", [os.environ.get("CXX") or "c++", "--version"])]:
        out = command_output(args)
        if out is not None:
            lines = out.splitlines()
            facts[name] = lines[-1] if name == "nvcc" else lines[0]
    for module in ["setuptools", "wheel", "pip", "pybind11", "pytest", "numpy"]:
        try:
            facts[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001
            facts[module] = None
    return facts


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def catch2_counts(log: str) -> Dict[str, object]:
    """Passed / failed / skipped test cases from Catch2's console output."""
    skipped = sum(log.count(text) for text in SKIP_TEXTS)
    failed_names = []
    # A failure is reported under a header: a rule, the case's name, ..., a rule.
    blocks = re.split(r"\n-{79}\n", log)
    for k in range(1, len(blocks) - 1, 2):
        if "FAILED:" in blocks[k + 1] or "due to unexpected exception" in blocks[k + 1]:
            name = blocks[k].strip().splitlines()[0]
            if name not in failed_names:
                failed_names.append(name)
    m = re.search(r"All tests passed \((\d+) assertions? in (\d+) test cases?\)", log)
    if m:
        total = int(m.group(2))
        return {"passed": total - skipped, "failed": 0, "skipped": skipped, "failures": []}
    m = re.search(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed", log)
    if m:
        return {"passed": int(m.group(2)) - skipped, "failed": int(m.group(3)),
                "skipped": skipped, "failures": failed_names}
    m = re.search(r"test cases:\s*(\d+)\s*\|\s*(\d+) failed", log)
    if m:
        return {"passed": 0, "failed": int(m.group(2)), "skipped": skipped,
                "failures": failed_names}
    return {"passed": None, "failed": None, "skipped": skipped, "failures": failed_names,
            "note": "no Catch2 summary (crashed, killed or not run)"}


def pytest_counts(log: str) -> Dict[str, object]:
    """Passed / failed / skipped tests from pytest's last summary line."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    summary = None
    for line in log.splitlines():
        if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", line) and " in " in line:
            summary = line
    if summary is None:
        return {"passed": None, "failed": None, "skipped": None,
                "failures": [], "note": "no pytest summary (crashed, killed or not run)"}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
        counts["error" if word.startswith("error") else word] += int(number)
    failures = [line.split(" - ")[0].split(" ", 1)[1]
                for line in log.splitlines() if re.match(r"^(FAILED|ERROR) ", line)]
    return {"passed": counts["passed"], "failed": counts["failed"] + counts["error"],
            "skipped": counts["skipped"], "failures": failures}


def fmt(value: object) -> str:
    return "—" if value is None else str(value)


def write(logs: str, out: str) -> None:
    facts: Dict[str, object] = {}
    try:
        facts = json.loads(read(os.path.join(logs, "env.json")) or "{}")
    except ValueError:
        pass
    steps = []
    for line in read(os.path.join(logs, "steps.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) == 5:
            steps.append(dict(zip(["name", "outcome", "rc", "seconds", "kind"], parts)))
    failed_steps = [s for s in steps if s["outcome"] not in ("ok", "not run (out of time)")
                    or (s["kind"] == "required" and s["outcome"] != "ok")]
    cuda = bool(facts.get("cuda_available"))

    lines = ["# gpipe GPU check", ""]
    device = facts.get("device") or "no CUDA device"
    if cuda:
        device = (f"{device} ({facts.get('device_memory_gib')} GiB, sm {facts.get('capability')}, "
                  f"{facts.get('device_count')} visible)")
    lines += [f"- device: {device}",
              f"- driver: {fmt(facts.get('nvidia_smi'))}",
              f"- torch {fmt(facts.get('torch'))}, CUDA {fmt(facts.get('torch_cuda'))}; "
              f"nvcc: {fmt(facts.get('nvcc'))}",
              f"- {fmt(facts.get('cores'))} cores; {fmt(facts.get('cmake'))}; "
              f"ninja {fmt(facts.get('ninja'))}; {fmt(facts.get('cxx'))}",
              f"- date: {fmt(facts.get('date'))}"]
    if "torch_error" in facts:
        lines.append(f"- torch failed to import: {facts['torch_error']}")
    verdict = "PASS" if not failed_steps else f"FAIL ({len(failed_steps)} step(s) failed: " + \
        ", ".join(s["name"] for s in failed_steps) + ")"
    if not cuda:
        verdict += " — no CUDA device: the CUDA tests skipped and only the build was proven"
    lines += ["", f"**Result: {verdict}**", ""]

    lines += ["## Suites", "", "| suite | passed | failed | skipped | note |",
              "|---|---|---|---|---|"]
    failure_lines: List[str] = []
    for step, title, kind in SUITES:
        record = next((s for s in steps if s["name"] == step), None)
        if record is None or record["outcome"].startswith("not run"):
            why = record["outcome"] if record else "not run"
            lines.append(f"| {title} | — | — | — | {why} |")
            continue
        log = read(os.path.join(logs, f"{step}.log"))
        counts = catch2_counts(log) if kind == "catch2" else pytest_counts(log)
        note = counts.get("note", "")
        if record["outcome"] != "ok":
            note = (note + "; " if note else "") + record["outcome"]
        lines.append(f"| {title} | {fmt(counts['passed'])} | {fmt(counts['failed'])} | "
                     f"{fmt(counts['skipped'])} | {note} |")
        failure_lines += [f"- {title}: {name}" for name in counts["failures"]]
    if failure_lines:
        lines += ["", "Failed tests:", ""] + failure_lines

    bench_log = read(os.path.join(logs, "bench.log"))
    bench_lines = [line for line in bench_log.splitlines() if line.startswith("BENCH ")]
    memory_lines = [line.strip() for step in ("catch2-cuda", "pytest-cuda")
                    for line in read(os.path.join(logs, f"{step}.log")).splitlines()
                    if "checkpoint memory" in line]
    lines += ["", "## Bench (bench/gpu.py)", ""]
    if bench_lines:
        lines += ["```"] + bench_lines + ["```", "", "<details><summary>bench output</summary>",
                                          "", "```", bench_log.strip(), "```", "</details>"]
    elif "skipped: no CUDA" in bench_log:
        lines.append("skipped: no CUDA device")
    else:
        lines.append("no BENCH lines (see logs/bench.log)")
    if memory_lines:
        lines += ["", "Checkpoint memory as the tests measured it:", "", "```"] + memory_lines + \
            ["```"]

    sim_lines = [line for line in read(os.path.join(logs, "bench-sim.log")).splitlines()
                 if line.startswith("BENCH ") or "hardware threads" in line]
    if sim_lines:
        lines += ["", "## Schedules on simulated devices (bench_sim --schedules, CPU)", "",
                  "```"] + sim_lines + ["```"]

    lines += ["", "## Steps", "", "| step | outcome | exit | seconds | kind |", "|---|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['outcome']} | {s['rc']} | {s['seconds']} | {s['kind']} |"
              for s in steps]
    lines += ["", "Logs: `logs/<step>.log` beside this report."]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] == "env":
        print(json.dumps(env(), indent=1))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
