"""Named kinds of a model setting, and the registry of residual branch kinds.

A :class:`Registry` maps the names a choice setting admits to what builds each kind; the
setting's admissible values are the registry's live :attr:`~Registry.choices`, so a kind
registered after :class:`~iresflow.models.config.ModelConfig` was defined validates and appears
among the command line's choices. Two registries exist: :data:`BRANCH_KINDS` (the residual
layers of a block recipe, setting ``layers``; filled with the built-in kinds by
:mod:`iresflow.models.branches`) and :data:`~iresflow.models.distributions.BASES` (the base
densities, setting ``base``). A new kind is one module and one call of :func:`register_branch`
or :func:`~iresflow.models.distributions.register_base`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from torch import nn

from iresflow.nn.base import LipschitzBranch

__all__ = ["BRANCH_KINDS", "BranchKind", "Registry", "RegistryChoices", "register_branch"]

E = TypeVar("E")

#: Admissible kind names: lower-case letters, digits, ``-`` and ``_``, starting with a letter
#: (no ``.`` or ``,``: names become step names and comma-separated command-line lists).
NAME = re.compile(r"[a-z][a-z0-9_-]*")


class RegistryChoices(Sequence[str]):
    """The names a setting admits, read from its registry at every use: the registered names in
    registration order, then the fixed ones."""

    def __init__(self, registry: Registry[Any]) -> None:
        self.registry = registry

    def _names(self) -> tuple[str, ...]:
        return (*self.registry, *self.registry.fixed)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self.registry or name in self.registry.fixed

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class Registry(Mapping[str, E], Generic[E]):
    """Named kinds of one choice setting: a read-only mapping from name to entry.

    Args:
        what: What a kind is, for error messages (``"branch kind"``).
        fixed: Further names the setting admits that are not entries (and cannot be
            registered), e.g. ``"mix"`` among the layer kinds.

    Example:
        >>> colours = Registry("colour", fixed=("none",))
        >>> colours.register("red", 0xFF0000)
        >>> "red" in colours.choices, tuple(colours.choices), colours["red"]
        (True, ('red', 'none'), 16711680)
        >>> colours.unregister("red")
        >>> tuple(colours.choices)
        ('none',)
    """

    def __init__(self, what: str, fixed: tuple[str, ...] = ()) -> None:
        self.what = what
        self.fixed = fixed
        self._entries: dict[str, E] = {}
        #: The admissible values of the setting, live (see :class:`RegistryChoices`).
        self.choices = RegistryChoices(self)

    def register(self, name: str, entry: E) -> None:
        """Add a kind.

        Args:
            name: Its name: lower-case letters, digits, ``-`` and ``_``, starting with a letter.
            entry: What builds it.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``name`` is malformed, already registered or one of the fixed names.
        """
        if not isinstance(name, str):
            raise TypeError(f"{self.what} name must be a str, got {type(name).__name__}")
        if not NAME.fullmatch(name):
            raise ValueError(f"{self.what} name must be lower-case letters, digits, '-' and '_', "
                             f"starting with a letter, got {name!r}")
        if name in self.choices:
            raise ValueError(f"{self.what} {name!r} is already registered "
                             f"(known: {', '.join(self.choices)})")
        self._entries[name] = entry

    def unregister(self, name: str) -> None:
        """Remove a registered kind.

        Raises:
            ValueError: ``name`` is not registered.
        """
        if name not in self._entries:
            raise ValueError(f"no {self.what} {name!r} is registered "
                             f"(known: {', '.join(self._entries)})")
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> E:
        if name not in self._entries:
            raise KeyError(f"unknown {self.what} {name!r} (known: {', '.join(self._entries)})")
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._entries)})"


#: ``build(config, encoding) -> branch``: the contractive branch of a residual step from the
#: model's :class:`~iresflow.models.config.ModelConfig` and, for a kind that asks for it, the
#: model's positional encoding (one module shared by all its steps; ``None`` otherwise).
BranchBuilder = Callable[[Any, "nn.Module | None"], LipschitzBranch]


@dataclass(frozen=True)
class BranchKind:
    """A residual layer kind: how to build its branch, and what it is.

    Attributes:
        build: The :data:`BranchBuilder`; it returns the unconditional branch (a conditional
            model wraps it in a :class:`~iresflow.nn.conditional.ConditionalBranch`).
        help: One line saying what the kind is.
        positional: Whether ``build`` takes the model's positional encoding.
    """

    build: BranchBuilder
    help: str
    positional: bool = False


#: The residual layer kinds of a block recipe (model setting ``layers``), by name; ``"mix"``
#: (an LU feature mixing, no residual step) is a fixed name of the setting.
BRANCH_KINDS: Registry[BranchKind] = Registry("branch kind", fixed=("mix",))


def register_branch(
    name: str, build: BranchBuilder, help: str, *, positional: bool = False
) -> None:
    """Register a residual layer kind, usable in the model setting ``layers``.

    Every layer of that kind in a block recipe becomes ``ActNorm -> x + g(x)`` with
    ``g = build(config, encoding)``; ``build`` must return a
    :class:`~iresflow.nn.base.LipschitzBranch` certified below 1 (e.g. at ``config.coeff``).

    Args:
        name: The kind's name: lower-case letters, digits, ``-`` and ``_``, starting with a
            letter, not yet a layer kind.
        build: ``build(config, encoding) -> LipschitzBranch`` (:data:`BranchBuilder`).
        help: One line saying what the kind is.
        positional: Whether ``build`` takes the model's positional encoding (else ``None``).

    Raises:
        TypeError: ``name`` or ``help`` is not a string, or ``build`` is not callable.
        ValueError: ``name`` is malformed or already a layer kind, or ``help`` is empty.

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> def wide_mlp(config, encoding):
        ...     return LipschitzMLP((config.features, 4 * config.hidden, config.features),
        ...                         coeff=config.coeff ** 0.5)
        >>> register_branch("wide-mlp", wide_mlp, "an MLP four times as wide")
        >>> "wide-mlp" in BRANCH_KINDS.choices
        True
        >>> BRANCH_KINDS.unregister("wide-mlp")
    """
    if not callable(build):
        raise TypeError(f"build must be callable, got {type(build).__name__}")
    if not isinstance(help, str):
        raise TypeError(f"help must be a str, got {type(help).__name__}")
    if not help.strip():
        raise ValueError("help must say what the kind is, got an empty string")
    BRANCH_KINDS.register(name, BranchKind(build, help, bool(positional)))
