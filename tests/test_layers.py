"""Every module's imports follow the layer table in DESIGN.md, and no import circle exists.

The table's rows name each layer (first column) and, in backticks in its third column, the
labkit layers it may import. A module belongs to the layer whose name its dotted path
starts with most specifically (`labkit.serve.replay` is `serve`; `labkit` alone is the
package's facade, which re-exports the layers it imports). Every import counts, at module
level or inside a function: a function-local import only delays a circle or an upward
import, it does not remove it.

The negative controls plant an upward import and a circle in a copy of the real graph and
check that each is reported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labkit"
BACKTICKED = r"`([\w.]+)`"
Layers = dict[str, tuple[set[str], set[str]]]  # layer -> (its module paths, the layers it may import)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(module: str, source: str) -> set[str]:
    """The labkit modules `source` imports, anywhere in it: `from P import N` names module P.N
    when that is a module, else P."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "labkit"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "labkit":
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= submodules or {node.module}
            if len(submodules) < len(node.names):
                found.add(node.module)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    return {module: imports_of(module, path.read_text()) for module, path in MODULES.items()}


def layer_table() -> Layers:
    """{layer: (its module paths, the layers it may import)}, read from DESIGN.md's "Layers"
    table: a row whose first cell names modules in backticks (`sched`, or `cli`, `__main__`)
    is a layer named by its first module; the backticked layer names in its third cell are
    what it may import."""
    section = (ROOT / "DESIGN.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = line.split("|")[1:-1]
            names = re.findall(BACKTICKED, cells[0])
            layers[names[0]] = ({_path(name) for name in names}, set(re.findall(BACKTICKED, cells[2])))
    return {name: (paths, allowed & layers.keys()) for name, (paths, allowed) in layers.items()}


def _path(name: str) -> str:
    return "labkit" if name == "labkit" else f"labkit.{name}"


def layer_of(module: str, layers: Layers) -> str:
    """The layer whose module path `module` is, or lies in (the most specific; `labkit` itself
    only for the package's own `__init__`)."""
    candidates = [(len(path), name) for name, (paths, _) in layers.items() for path in paths
                  if module == path or (path != "labkit" and module.startswith(f"{path}."))]
    assert candidates, f"{module}: no layer in DESIGN.md's table holds it"
    return max(candidates)[1]


def against_the_layers(graph: dict[str, set[str]], layers: Layers) -> list[str]:
    """Each import of a layer its importer may not import, as 'importer -> imported'."""
    wrong = []
    for module, imported in sorted(graph.items()):
        home = layer_of(module, layers)
        for target in sorted(imported):
            there = layer_of(target, layers)
            if there != home and there not in layers[home][1]:
                wrong.append(f"{module} ({home}) -> {target} ({there})")
    return wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle, as the modules around it, found by depth-first search."""
    found, state = [], {}
    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_every_import_follows_the_layer_table():
    assert against_the_layers(import_graph(), layer_table()) == []


def test_no_module_imports_another_that_imports_it_back():
    assert circles(import_graph()) == []


def test_a_planted_upward_import_is_reported():
    graph = import_graph()
    graph["labkit.sched.policy"] = graph["labkit.sched.policy"] | {"labkit.engine.engine"}
    assert against_the_layers(graph, layer_table()) == ["labkit.sched.policy (sched) -> labkit.engine.engine (engine)"]


def test_a_planted_circle_is_reported():
    graph = import_graph()
    assert "labkit.traffic" in graph["labkit.sched.driver"]
    graph["labkit.traffic"] = graph["labkit.traffic"] | {"labkit.sched.driver"}
    assert any({"labkit.traffic", "labkit.sched.driver"} <= set(circle) for circle in circles(graph))


def test_every_module_has_a_layer_and_every_layer_a_module():
    layers = layer_table()
    homes = {layer_of(module, layers) for module in MODULES}
    assert homes == set(layers), f"layers with no module: {set(layers) - homes}"


@pytest.mark.parametrize("source, expected", [
    ("from labkit.sched import policy, StepLog", {"labkit.sched.policy", "labkit.sched"}),
    ("import labkit.engine.model as m", {"labkit.engine.model"}),
    ("def f():\n    from labkit.viz import figures", {"labkit.viz.figures"}),
    ("from . import x\nimport numpy", set()),
])
def test_what_counts_as_an_import(source, expected):
    assert imports_of("labkit.somewhere", source) == expected
