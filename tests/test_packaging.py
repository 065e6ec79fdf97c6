"""Setup files agree, and the pure layers stay pure."""

import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch", "playwright": "playwright-python", "prometheus-client": "prometheus_client"}  # PyPI name -> conda-forge name where they differ


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = project["dependencies"] + extras["lab"] + extras["serve"] + extras["test"]
    return {CONDA_NAMES.get(r.split(">=")[0], r.split(">=")[0]) + ">=" + r.split(">=")[1] for r in requirements}


def _conda_requirements() -> set[str]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert environment["channels"] == ["conda-forge"]
    listed = [d for d in environment["dependencies"] if isinstance(d, str)]
    return {d for d in listed if not d.startswith(("python", "pip"))}


def test_environment_yml_lists_what_pyproject_lists():
    assert _conda_requirements() == _pyproject_requirements()


def test_binder_finds_an_exact_python_version_it_can_build():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    (python,) = [d for d in environment["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert re.fullmatch(r"python=3\.1[1-3]", python), "repo2docker needs python=x.y, within requires-python"


def test_pyproject_declares_anywidget_and_torch():
    names = {r.split(">=")[0] for r in _pyproject_requirements()}
    assert {"anywidget", "pytorch", "plotly", "ipywidgets"} <= names


def test_pre_commit_strips_notebooks_as_run_notebooks_does_and_lints_them():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    assert hooks["nbstripout"]["args"] == runpy.run_path(str(ROOT / "tools" / "run_notebooks.py"))["STRIP_FLAGS"]
    assert "jupyter" in hooks["ruff"]["types_or"]


def test_pure_layers_import_no_heavy_library():
    code = (
        "import sys, labkit.sched, labkit.sched.overlap, labkit.analysis, labkit.analysis.lanes, labkit.analysis.host,"
        " labkit.analysis.ordering, labkit.analysis.tradeoff, labkit.theory, labkit.traffic, labkit, labkit.serve,"
        " labkit.serve.tokenizer;"
        "print(sorted({'torch', 'plotly', 'ipywidgets'} & set(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"

