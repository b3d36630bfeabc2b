"""The package as a whole: its import graph has no cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import iresflow

PACKAGE = Path(iresflow.__file__).resolve().parent


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """Modules named by the imports of a module: at module level (also under ``if
    TYPE_CHECKING``) and deferred ones inside functions, which would hide a cycle."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # a submodule, or a name defined by the module `base`
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Edges from every module of a package to the modules of the package it imports."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = _imports(tree, name, path.name == "__init__.py", set(files))
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as a list of nodes, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_import_graph_sees_the_package():
    graph = import_graph()
    assert "iresflow.transforms.residual" in graph["iresflow.models.transformer"]
    assert "iresflow.logdet.base" in graph["iresflow.logdet.factory"]


def test_import_graph_is_acyclic():
    assert find_cycle(import_graph()) is None


def test_docs_and_docstrings_cite_only_pages_the_repo_ships() -> None:
    """Every mathematical reference points into docs/ (no external specification)."""
    root = Path(__file__).resolve().parents[1]
    sources = [root / "README.md", *root.glob("docs/*.md")]
    for folder in ("iresflow", "tests", "benchmarks", "examples"):
        sources += (root / folder).rglob("*.py")
    spec = "MATH" + ".md"
    offenders = [str(p.relative_to(root)) for p in sources if spec in p.read_text("utf-8")]
    assert offenders == []
    anchors = set(re.findall(r"\{#([a-z0-9-]+)\}", (root / "docs" / "math.md").read_text("utf-8")))
    cited = set()
    for path in sources:
        cited |= set(re.findall(r"docs/math\.md#([a-z0-9-]+)", path.read_text("utf-8")))
    assert cited and cited <= anchors, sorted(cited - anchors)


def test_training_and_runs_see_only_the_flow_contract() -> None:
    """train/, runs/ and the CLI depend on SequenceFlow; only the model factory names the
    concrete model class (docstring examples, ``>>>`` lines, may build one)."""
    files = [PACKAGE / "cli.py", *(PACKAGE / "train").rglob("*.py"),
             *(PACKAGE / "runs").rglob("*.py")]
    assert len(files) > 20
    offenders = []
    for path in files:
        if path == PACKAGE / "train" / "factories.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "ResidualFlowTransformer" in line and not line.lstrip().startswith((">>>", "...")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}")
    assert offenders == []
    factory = (PACKAGE / "train" / "factories.py").read_text()
    assert "ResidualFlowTransformer(" in factory  # the test looks where the name is
