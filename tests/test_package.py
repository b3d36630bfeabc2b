"""The package as a whole: its import graph has no cycle and no module reaches into another's
private names."""

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
    assert "iresflow.transforms.residual" in graph["iresflow.models.branches"]
    assert "iresflow.logdet.base" in graph["iresflow.logdet.factory"]


def test_import_graph_is_acyclic():
    assert find_cycle(import_graph()) is None


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    anchor = name.split(".") if is_package else name.split(".")[:-1]
    anchor = anchor[: len(anchor) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def _private_module_outside(module: str, own_package: str) -> bool:
    """Whether ``module`` has a private component (``a.b._c``) and the importer lies outside
    the package that holds it (``a.b``): private modules serve their own package."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            holder = ".".join(parts[:i])
            return not (own_package == holder or own_package.startswith(holder + "."))
    return False


def private_imports(package: Path = PACKAGE) -> list[str]:
    """Every access of a module of ``package`` to another module's private names.

    Forbidden: ``from pkg.x import _name`` (a private function, class or constant), importing a
    private module ``pkg.x._y`` from outside ``pkg.x`` (``import pkg.x._y``, ``from pkg.x._y
    import ...``, ``from pkg.x import _y``), and ``x._name`` on a module ``x`` bound by an import.

    Returns:
        ``"path:line: what"`` for every offence, in file order.
    """
    root = package.name
    files = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    found = []
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        own = name if is_package else name.rpartition(".")[0]
        where = f"{path.relative_to(package.parent)}:"
        modules: set[str] = set()  # local names bound to modules of the package
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root:
                        modules.add(alias.asname or alias.name.split(".")[0])
                        if _private_module_outside(alias.name, own):
                            found.append(f"{where}{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(node, name, is_package)
                if module.split(".")[0] != root:
                    continue
                if _private_module_outside(module, own):
                    found.append(f"{where}{node.lineno}: from {module} import ...")
                    continue
                for alias in node.names:
                    target = f"{module}.{alias.name}"
                    if target in files:  # a submodule
                        modules.add(alias.asname or alias.name)
                        private = _private_module_outside(target, own)
                    else:
                        private = alias.name.startswith("_")
                    if private:
                        found.append(f"{where}{node.lineno}: from {module} import {alias.name}")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{where}{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_private_import_finder_finds_every_kind(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "_gate.py": "def check(): pass\n",
        "a.py": "def _helper(): pass\ndef public(): pass\n",
        "sub/__init__.py": "",
        "sub/_state.py": "X = 1\n",
        "sub/b.py": "from pkg._gate import check\nfrom pkg.sub._state import X\n"
                    "from pkg.sub import _state\nfrom . import _state as s\n",
        "c.py": "from pkg.a import _helper, public\nimport pkg.sub._state\n"
                "from pkg.sub._state import X\nfrom pkg.sub import _state\n"
                "from pkg import a\na._helper()\na.public()\n",
    }
    for relative, text in sources.items():
        (package / relative).write_text(text)
    assert private_imports(package) == [
        "pkg/c.py:1: from pkg.a import _helper",
        "pkg/c.py:2: import pkg.sub._state",
        "pkg/c.py:3: from pkg.sub._state import ...",
        "pkg/c.py:4: from pkg.sub import _state",
        "pkg/c.py:6: a._helper",
    ]


def test_no_module_imports_another_modules_private_names() -> None:
    assert private_imports() == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_attributes(source: str) -> list[str]:
    """Reads of another object's private attribute in a module's ``source``.

    ``obj._name`` is allowed for ``obj`` = ``self``/``cls``, for a ``_name`` the module itself
    defines (a hook its base class declares, state of its own class), and on third-party modules
    (``torch._C``, ``os._exit``: outside the package's contract).

    Returns:
        ``"line N: expression"`` for every offence.
    """
    tree = ast.parse(source)
    own: set[str] = set()
    outside: set[str] = set()  # names bound to modules of other distributions
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Import):
            outside |= {(a.asname or a.name).split(".")[0] for a in node.names
                        if not a.name.startswith("iresflow")}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in own:
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and (root.id in outside or (
                root is node.value and root.id in ("self", "cls"))):
            continue
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_private_attribute_finder() -> None:
    source = (
        "import torch\n"
        "class Flow:\n"
        "    def _own(self):\n"
        "        self._cache = self.transform._forward(1)\n"
        "        return other._own, other._cache, self._ok, torch._C._functorch\n"
    )
    assert private_attributes(source) == ["line 4: self.transform._forward"]


def test_no_module_reads_private_attributes_of_other_objects() -> None:
    found = {str(path.relative_to(PACKAGE.parent)): private_attributes(path.read_text())
             for path in sorted(PACKAGE.rglob("*.py"))}
    assert {path: lines for path, lines in found.items() if lines} == {}


#: The package's only uses of torch's private names: PyTorch has no public way to ask whether a
#: ``torch.func`` transform is active, or whether a tensor is one of its wrappers.
PRIVATE_TORCH_ALLOWED = {
    "iresflow/_validation.py": {"torch._C._functorch.peek_interpreter_stack",
                                "torch._C._functorch.is_functorch_wrapped_tensor"},
}


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def private_torch_names(source: str) -> set[str]:
    """Dotted names rooted at ``torch`` with a private component (``torch._standard_gamma``,
    ``torch.nn._x``), in attribute chains and imports of a module's ``source``; of nested
    chains only the longest."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (name := _dotted(node)) is not None:
            names.add(name)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    private = {name for name in names if name.split(".")[0] == "torch"
               and any(_private(part) for part in name.split(".")[1:])}
    return {name for name in private if not any(other.startswith(name + ".") for other in private)}


def test_private_torch_finder() -> None:
    source = ("import torch\nimport torch._dynamo\nfrom torch.nn import _reduction\n"
              "x = torch._standard_gamma(a)\ny = torch.nn.functional.relu(a)._values()\n")
    assert private_torch_names(source) == {
        "torch._dynamo", "torch.nn._reduction", "torch._standard_gamma"}


def test_no_private_torch_names_in_the_package() -> None:
    found = {str(path.relative_to(PACKAGE.parent)): private_torch_names(path.read_text())
             for path in sorted(PACKAGE.rglob("*.py"))}
    found = {path: names for path, names in found.items() if names}
    assert found == PRIVATE_TORCH_ALLOWED


def test_docs_and_docstrings_cite_only_pages_the_repo_ships() -> None:
    """Every mathematical reference points into docs/ (no external specification)."""
    root = Path(__file__).resolve().parents[1]
    sources = [root / "README.md", *root.glob("docs/*.md")]
    for folder in ("iresflow", "tests", "benchmarks", "examples"):
        sources += (root / folder).rglob("*.py")
    spec = "MATH" + ".md"
    offenders = [str(p.relative_to(root)) for p in sources if spec in p.read_text("utf-8")]
    assert offenders == []
    for page in ("math", "forecasting"):
        text = (root / "docs" / f"{page}.md").read_text("utf-8")
        anchors = set(re.findall(r"\{#([a-z0-9-]+)\}", text))
        cited = set()
        for path in sources:
            cited |= set(re.findall(rf"docs/{page}\.md#([a-z0-9-]+)", path.read_text("utf-8")))
        assert cited and cited <= anchors, (page, sorted(cited - anchors))


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
            if "ResidualSequenceFlow" in line and not line.lstrip().startswith((">>>", "...")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}")
    assert offenders == []
    factory = (PACKAGE / "train" / "factories.py").read_text()
    assert "ResidualSequenceFlow(" in factory  # the test looks where the name is
