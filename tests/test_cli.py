"""The `labkit demo` command: its report on tiny runs, and one clean line for every bad option."""

import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.viz.animation import PLOTLY_CDN_SCRIPT

TOY = ["demo", "--trace", "toy", "--slots", "2", "--no-progress", "--device", "cpu", "--threads", "1"]


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Cells of the report's table rows, keyed by policy name."""
    rows = [line.split() for line in stdout.splitlines()]
    return {cells[0]: cells[1:] for cells in rows if cells and cells[0] in ("static", "continuous")}


def write_csv(path, rows: list[str]):
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(row + "\n" for row in rows))
    return str(path)


def test_toy_demo_reports_both_policies(capsys):
    assert main(TOY) == 0
    out = capsys.readouterr().out
    assert "device: cpu (1 CPU thread(s), float32, CUDA graphs off, overlap off)" in out
    assert "3.67M parameters" in out and "batched attention" in out and "toy: requests A-H" in out
    rows = table_rows(out)
    assert list(rows) == ["static", "continuous"]
    assert rows["static"][:2] == ["23", "69.6"]
    assert rows["continuous"][:2] == ["17", "94.1"]
    assert rows["static"][-2:] == ["1.00x", "1.00x"]
    assert rows["continuous"][-2] == "1.35x"  # 23 / 17 slot-steps, from the simulator


def test_overlap_gives_the_same_schedule_and_reports_the_idle_device(capsys):
    assert main([*TOY, "--overlap"]) == 0
    out = capsys.readouterr().out
    assert "overlap on)" in out
    rows = table_rows(out)
    assert rows["continuous"][:2] == ["17", "94.1"]
    assert all(0 <= float(row[2]) < 100 for row in rows.values())  # device idle (%)


def test_the_per_request_layout_gives_the_same_schedule(capsys):
    assert main([*TOY, "--attention", "per_request"]) == 0
    out = capsys.readouterr().out
    assert "per_request attention" in out
    assert table_rows(out)["continuous"][:2] == ["17", "94.1"]


def test_sampled_trace_with_poisson_arrivals(capsys):
    assert main(["demo", "--requests", "4", "--slots", "2", "--rate", "50", "--seed", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Poisson arrivals at 50 requests/s, seed 3" in out and "Trace(4 requests" in out
    assert list(table_rows(out)) == ["static", "continuous"]


def test_csv_trace_skips_requests_longer_than_the_model(tmp_path, capsys):
    path = write_csv(tmp_path / "trace.csv", [
        "2023-11-16 18:15:46.6805900,3000,5",  # longer than max_seq_len 2048
        "2023-11-16 18:15:46.7000000,4,3",
        "2023-11-16 18:15:47.0000000,2,2",
        "2023-11-16 18:15:48.0000000,1,4",
    ])
    assert main(["demo", "--trace", path, "--requests", "2", "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "the first 2 requests with prompt + output <= max_seq_len 2048 (1 longer ones skipped)" in out
    assert "Trace(2 requests, 5 output tokens" in out


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0"], "argument --slots: '0': must be a whole number >= 1"),
    (["--slots", "two"], "argument --slots: 'two': must be a whole number >= 1"),
    (["--requests", "-3"], "argument --requests: '-3': must be a whole number >= 1"),
    (["--seed", "-1"], "argument --seed: '-1': must be a whole number >= 0"),
    (["--rate", "-1"], "argument --rate: '-1': must be a number > 0"),
    (["--rate", "nan"], "argument --rate: 'nan': must be a number > 0"),
    (["--trace", "toy", "--rate", "5"], "argument --rate: only --trace exponential samples arrivals"),
    (["--device", "gpu"], "argument --device: device = 'gpu': must be one of auto, cpu, cuda, mps"),
    (["--threads", "0"], "argument --threads: '0': must be a whole number >= 1"),
    (["--attention", "orca"], "argument --attention: invalid choice: 'orca'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--trace", "nosuch.csv"], "argument --trace: nosuch.csv: no such file (choose toy, exponential, azure-conv"),
])
def test_bad_option_is_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, message)


@pytest.mark.parametrize("rows, message", [
    (["2023-11-16 18:15:46,12,seven"], "bad row at line 2"),
    (["2023-11-16 18:15:46,3000,5"], "no request has prompt + output <= 2048 tokens (the shortest has 3005)"),
])
def test_bad_csv_is_one_error_line(tmp_path, rows, message, capsys):
    path = write_csv(tmp_path / "bad.csv", rows)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--trace", path, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, message)


def assert_one_error_line(err: str, message: str):
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1], err
    assert errors[0].startswith("labkit demo: error: ") and message in errors[0]
    assert "Traceback" not in err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--slots", "--requests", "--trace", "--rate", "--device", "--attention", "--threads", "--dtype",
                   "--no-cuda-graphs", "--seed", "--no-progress"):
        assert option in out


@pytest.mark.integration  # starts a process
def test_python_dash_m_runs_the_toy_demo():
    result = subprocess.run(
        [sys.executable, "-m", "labkit", "demo", "--trace", "toy", "--slots", "2", "--no-progress", "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert list(rows) == ["static", "continuous"]
    assert (rows["static"][0], rows["continuous"][0]) == ("23", "17")


@pytest.mark.integration  # exports a lesson with nbconvert, as tests/test_html_export.py does
@pytest.mark.filterwarnings("ignore:Your element with mimetype.*vnd.plotly:UserWarning")
def test_export_html_writes_a_page_with_plotly_inside(tmp_path, capsys):
    target = tmp_path / "lesson01.html"
    lesson = Path(__file__).resolve().parents[1] / "solutions" / "01_static_vs_continuous.ipynb"  # the copies that keep outputs
    assert main(["export-html", str(lesson), str(target)]) == 0
    assert f"wrote {target}" in capsys.readouterr().out
    assert not PLOTLY_CDN_SCRIPT.search(target.read_text(encoding="utf-8"))  # plotly.js is inside instead


def test_export_html_names_a_missing_notebook(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export-html", str(tmp_path / "nope.ipynb"), str(tmp_path / "out.html")])
    assert exit_info.value.code == 2
    assert "argument notebook: " in (err := capsys.readouterr().err) and "nope.ipynb' is not a file" in err
