"""README.md holds true: every command it prints runs as written or says what it needs, and
every duration its teacher-facing sections state is within 25% of the measured run
(benchmarks/bench_course.py, saved in benchmarks/results/course-cpu.json).

The commands are the lines of its bash blocks and, above "The lessons in detail", the inline
code that starts with a command. `COMMANDS` says how each is checked: run as written, run
as a dry run (`make -n`, for targets that serve until stopped or run for minutes), or not
run, with what it needs. A command the table does not know fails the test, so a new one
cannot go unchecked.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from labkit.serve.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MEASURED = json.loads((ROOT / "benchmarks" / "results" / "course-cpu.json").read_text(encoding="utf-8"))
TOLERANCE = 0.25
BIN = Path(sys.executable).parent
COMMAND_WORDS = ("make ", "labkit ", "python ", "pip ", "conda ", "jupyter ", "huggingface-cli ", "source ")

RUN, DRY_RUN, SERVE = "run", "dry run", "serve"
COMMANDS = [  # (a pattern the whole command matches, how the test checks it)
    (r"make lab TORCH_INDEX=\S+", DRY_RUN),
    (r"make (lab|teach|present|notebooks|student|test|check|bench|vllm)( LESSON=\d\d)?", DRY_RUN),
    (r"VLLM_CPU_KVCACHE_SPACE=1 \.venv-vllm/bin/vllm serve DIR .*", "needs make vllm and a model directory "
     "(tests/test_vllm.py starts vllm serve where it is installed)"),
    (r"labkit replay .*--url http://127\.0\.0\.1:8001 --model DIR .*", "needs the vllm serve above"),
    (r"(python -m )?labkit (demo|export-html)\b.*", RUN),
    (r"labkit serve --slots .*", SERVE),
    (r"labkit replay .*--url http://127\.0\.0\.1:8000 .*", "replayed against the server above"),
    (r"labkit serve ~/models/.*", "needs a local model directory"),
    (r"huggingface-cli download .*", "needs the network and the model's license"),
    (r"pip install .*", "needs the network"),
    (r"conda (env create|activate) .*", "needs conda and the network"),
    (r"jupyter lab notebooks/", "serves until stopped, in the conda environment above"),
    (r"source \.venv/bin/activate", "changes the shell it runs in"),
    (r"labkit serve", "names the server in the course plan, not a command line"),
]


def readme_commands() -> list[str]:
    """Each command line of the bash blocks, comments stripped, then the top's inline commands."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    top = README[: README.index("## The lessons in detail")]
    inline = [code for code in re.findall(r"`([^`\n]+)`", top) if code.startswith(COMMAND_WORDS)]
    return list(dict.fromkeys(line for line in lines + inline if line and not line.startswith("#")))


def ways_of(command: str) -> list[str]:
    return [way for pattern, way in COMMANDS if re.fullmatch(pattern, command)]


def how(command: str) -> str:
    ways = ways_of(command)
    assert len(ways) == 1, f"{command!r}: matches {len(ways)} entries of COMMANDS, not one"
    return ways[0]


def checked_by(way: str) -> list[str]:
    """The commands checked one way (a command matching no entry, or several, is left to the test above)."""
    return [command for command in readme_commands() if ways_of(command) == [way]]


def test_every_command_the_readme_prints_is_checked_or_says_what_it_needs():
    commands = readme_commands()
    assert "make lab" in commands and "make test" in commands  # the extraction found the quick start
    for command in commands:
        how(command)


def test_a_command_the_table_does_not_know_fails():
    """Negative control: a new command is not waved through."""
    with pytest.raises(AssertionError, match="matches 0 entries"):
        how("make deploy")


def argv(command: str) -> list[str]:
    """The command as the README prints it, with labkit and python taken from this environment."""
    words = command.split()
    if words[0] == "labkit":
        return [str(BIN / "labkit"), *words[1:]]
    if words[:3] == ["python", "-m", "labkit"]:
        return [sys.executable, *words[1:]]
    return words


@pytest.mark.integration
@pytest.mark.parametrize("command", checked_by(DRY_RUN))
def test_every_make_command_is_a_target_that_runs(command):
    result = subprocess.run(["make", "-n", *command.split()[1:]], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
def test_the_cpu_wheel_index_reaches_pip():
    """`make -n` of the README's CPU line shows the index on torch's pip install."""
    (command,) = [c for c in readme_commands() if c.startswith("make lab TORCH_INDEX=")]
    index = command.split("=", 1)[1]
    result = subprocess.run(["make", "-n", "-B", *command.split()[1:]], cwd=ROOT, capture_output=True, text=True)
    (install,) = [line for line in result.stdout.splitlines() if "pip install" in line and "torch" in line]
    assert f"--index-url {index}" in install
    plain = subprocess.run(["make", "-n", "-B", "lab"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "--index-url" not in plain  # negative control: without the variable, pip's own index


@pytest.mark.integration
@pytest.mark.parametrize("command", checked_by(RUN))
def test_every_command_the_readme_runs_exits_0(command, tmp_path):
    """Run in a scratch folder (what a command writes lands there), with the repository's paths."""
    words = [str(ROOT / word) if (ROOT / word).exists() and "/" in word else word for word in argv(command)]
    result = subprocess.run(words, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.integration
def test_the_served_model_answers_the_readme_s_replay():
    (serve,) = checked_by(SERVE)
    (replay,) = checked_by("replayed against the server above")
    port = free_port()  # the README's port 8000 may be taken on a test machine
    server = subprocess.Popen(argv(serve.replace("--port 8000", f"--port {port}")), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_health(f"http://127.0.0.1:{port}/health", server)
        result = subprocess.run(argv(replay.replace(":8000", f":{port}")), cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_for_health(url: str, server: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited with {server.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url}: no answer within {seconds} s")


# Durations ---------------------------------------------------------------------------------------


def near(stated: float, measured: float) -> bool:
    return abs(stated - measured) <= TOLERANCE * measured


def course_plan_rows() -> dict[str, tuple[float, float]]:
    """(seconds run here, self-paced minutes) of each lesson row, by its two-digit number."""
    plan = README[README.index("## Course plan"): README.index("## Setting students up")]
    rows = re.findall(r"^\| (\d\d) [^|]+\|[^|]+\| ([\d.]+) s \| (\d+) min \|", plan, flags=re.M)
    return {number: (float(seconds), float(minutes)) for number, seconds, minutes in rows}


def measured_lessons() -> dict[str, tuple[float, float]]:
    return {name[:2]: (seconds, MEASURED["lesson_lengths"][name]["self_paced_minutes"])
            for name, seconds in MEASURED["lesson_seconds"].items()}


def test_the_course_plan_has_a_row_for_every_lesson_with_its_measured_times():
    rows, measured = course_plan_rows(), measured_lessons()
    lessons = sorted(path.name[:2] for path in (ROOT / "solutions").glob("*.ipynb"))
    assert sorted(rows) == sorted(measured) == lessons
    off = {number: (rows[number], measured[number]) for number in lessons
           if not (near(rows[number][0], measured[number][0]) and near(rows[number][1], measured[number][1]))}
    assert not off, f"stated (seconds, minutes) against measured: {off}"


def stated(pattern: str) -> list[float]:
    """Every number README.md states where `pattern` matches; at least one."""
    found = re.findall(pattern, README)
    assert found, f"{pattern!r}: not found in README.md"
    return [float(number) for number in found]


def test_every_stated_duration_is_the_measured_one():
    commands, install = MEASURED["command_seconds"], MEASURED["install"]
    lessons = MEASURED["lesson_seconds"]
    checks = {
        "make test": (stated(r"make test +#[^\n]*\(about (\d+) minutes here\)"), commands["make test"] / 60),
        "make check": (stated(r"make check +#[^\n]*\((\d+) s here\)"), commands["make check"]),
        "install": (stated(r"\((\d+) s here, with every package"), install["seconds"]),
        "venv size": (stated(r"creates \.venv \(([\d.]+) GB\)"), install["venv_gb"]),
        "heaviest lesson": (stated(r"The heaviest lesson takes (\d+) s here"), max(lessons.values())),
        "full course": (stated(r"about (\d+) hours self-paced\s+in\s+all"),
                        sum(length["self_paced_minutes"] for length in MEASURED["lesson_lengths"].values()) / 60),
    }
    off = {name: (numbers, measured) for name, (numbers, measured) in checks.items()
           if not all(near(number, measured) for number in numbers)}
    assert not off, f"stated against measured: {off}"


def test_a_stated_duration_off_by_more_than_a_quarter_fails():
    """Negative control of the tolerance."""
    assert near(44, 40) and not near(52, 40) and not near(29, 40)


@pytest.mark.integration
def test_make_lab_serves_the_lessons_as_this_user(tmp_path):
    """`make lab` as the user CI runs as (root here, where JupyterLab wants --allow-root)."""
    private = {f"JUPYTER_{kind}_DIR": str(tmp_path / kind.lower()) for kind in ("RUNTIME", "CONFIG", "DATA")}
    lab = subprocess.Popen(["make", "lab"], cwd=ROOT, env={**os.environ, **private, "BROWSER": "true"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = served_url(lab)
        wait_for_health(url.replace("/lab?", "/api/status?"), lab, seconds=30)  # it prints the URL a moment early
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)


def served_url(lab: subprocess.Popen, seconds: float = 120) -> str:
    """The http://127.0.0.1:PORT/lab?token=... line JupyterLab prints once it serves, read on a
    thread so that a server that prints nothing cannot hang the test."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in lab.stdout], daemon=True).start()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if found := re.search(r"http://127\.0\.0\.1:\d+/lab\?token=\w+", line):
            return found.group(0)
    raise AssertionError(f"make lab printed no URL within {seconds} s (exit status {lab.poll()})")
