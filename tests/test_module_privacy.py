"""The flow contract's modules use each other through public names only.

A name with one leading underscore is private to the module that defines it. In the modules
checked here no code reads a private attribute of another object (``obj._name`` with ``obj``
not ``self``/``cls``) unless the module itself defines ``_name`` (a hook of a base class it
declares, or state of its own class), imports a private name of another module, or imports a
private module (``iresflow.pkg._mod``) from outside its package ``iresflow.pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import iresflow

PACKAGE = Path(iresflow.__file__).resolve().parent
CHECKED = [
    *sorted((PACKAGE / "models").glob("*.py")),
    *sorted((PACKAGE / "logdet").glob("*.py")),
    *(PACKAGE / "transforms" / name for name in ("base.py", "actnorm.py", "residual.py")),
]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.Module) -> set[str]:
    """Names the module defines: functions, classes and assigned names or attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def private_uses(source: str, module: str) -> list[str]:
    """The uses of other modules' private names in ``source`` (the module ``module``)."""
    tree = ast.parse(source)
    own = _defined_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("iresflow"):
            parts = node.module.split(".")
            first = next((i for i, part in enumerate(parts) if _private(part)), None)
            package = ".".join(parts[:first])
            if first is not None and not (module + ".").startswith(package + "."):
                found.append(f"line {node.lineno}: import from {node.module}")
            found += [f"line {node.lineno}: import {alias.name} from {node.module}"
                      for alias in node.names if _private(alias.name)]
    return found


def test_the_checker_finds_private_uses():
    source = (
        "from iresflow.nn.conditional import _shift_net\n"
        "from iresflow.logdet._hutchinson import repeat_rows\n"
        "class Flow:\n"
        "    def _own(self):\n"
        "        self._cache = self.transform._forward(1)\n"
        "        return other._own, other._cache, self._private_ok\n"
    )
    assert private_uses(source, "iresflow.models.flow") == [
        "line 1: import _shift_net from iresflow.nn.conditional",
        "line 2: import from iresflow.logdet._hutchinson",
        "line 5: self.transform._forward",
    ]
    own_package = "from iresflow.logdet._hutchinson import repeat_rows\n"
    assert private_uses(own_package, "iresflow.logdet.exact") == []
    for module in ("iresflow.nn.mlp", "iresflow"):  # a module of the package, its __init__
        assert private_uses("from iresflow._validation import check_int\n", module) == []


def test_the_flow_contract_uses_no_private_name_of_another_module():
    offenders = {}
    for path in CHECKED:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = private_uses(path.read_text("utf-8"), module)
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert len(CHECKED) > 10 and offenders == {}
