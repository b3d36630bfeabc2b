"""Named kinds of a model setting, and the registry of layer kinds.

A :class:`Registry` maps the names a choice setting admits to what builds each kind; the
setting's admissible values are the registry's live :attr:`~Registry.choices`, so a kind
registered after :class:`~iresflow.models.config.ModelConfig` was defined validates and appears
among the command line's choices. Two registries exist: :data:`LAYERS` (the layers of a block
recipe, setting ``layers``; filled with the built-in kinds by :mod:`iresflow.models.branches`)
and :data:`~iresflow.models.distributions.BASES` (the base densities, setting ``base``). A layer
kind declares its structure only: a *residual* kind builds a contractive branch ``g`` that the
model wraps as ``ActNorm -> x + g(x)`` (:func:`register_branch`), a *step* kind builds an
invertible step used as it is (:func:`register_step`). A new kind is one module and one call of
:func:`register_branch`, :func:`register_step` or
:func:`~iresflow.models.distributions.register_base`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from torch import nn

__all__ = [
    "LAYERS",
    "LayerKind",
    "Registry",
    "RegistryChoices",
    "register_branch",
    "register_step",
]

E = TypeVar("E")

#: Admissible kind names: lower-case letters, digits, ``-`` and ``_``, starting with a letter
#: (no ``.`` or ``,``: names become step names and comma-separated command-line lists).
NAME = re.compile(r"[a-z][a-z0-9_-]*")


class RegistryChoices(Sequence[str]):
    """The names a setting admits, read from its registry at every use, in registration
    order."""

    def __init__(self, registry: Registry[Any]) -> None:
        self.registry = registry

    def _names(self) -> tuple[str, ...]:
        return tuple(self.registry)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self.registry

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class Registry(Mapping[str, E], Generic[E]):
    """Named kinds of one choice setting: a read-only mapping from name to entry.

    Args:
        what: What a kind is, for error messages (``"layer kind"``).

    Example:
        >>> colours = Registry("colour")
        >>> colours.register("red", 0xFF0000)
        >>> "red" in colours.choices, tuple(colours.choices), colours["red"]
        (True, ('red',), 16711680)
        >>> colours.unregister("red")
        >>> tuple(colours.choices)
        ()
    """

    def __init__(self, what: str) -> None:
        self.what = what
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
            ValueError: ``name`` is malformed or already registered.
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


#: ``build(config, encoding) -> module``: the contractive branch of a residual kind (a
#: :class:`~iresflow.nn.base.LipschitzBranch`) or the invertible step of a step kind (a
#: :class:`~iresflow.transforms.base.SequenceTransform`), from the model's
#: :class:`~iresflow.models.config.ModelConfig` and, for a kind that asks for it, the model's
#: positional encoding (one module shared by all its layers; ``None`` otherwise). A kind
#: registered with ``per_block=True`` is also given the index of its block, ``block=i``.
LayerBuilder = Callable[..., nn.Module]


@dataclass(frozen=True)
class LayerKind:
    """A layer kind of a block recipe: how to build it, what it is and how it enters the chain.

    Attributes:
        build: The :data:`LayerBuilder`.
        help: One line saying what the kind is.
        residual: ``True``: ``build`` returns the unconditional contractive branch ``g`` of a
            residual step ``ActNorm -> x + g(x)`` (a conditional model wraps it in a
            :class:`~iresflow.nn.conditional.ConditionalBranch`); ``False``: ``build`` returns an
            invertible step, conditional by itself where the kind supports a context.
        positional: Whether ``build`` takes the model's positional encoding.
        per_block: Whether ``build`` takes the index of its block (keyword ``block``, 0 for
            the block nearest the data), for kinds that change with depth.
    """

    build: LayerBuilder
    help: str
    residual: bool = True
    positional: bool = False
    per_block: bool = False


#: The layer kinds of a block recipe (model setting ``layers``), by name.
LAYERS: Registry[LayerKind] = Registry("layer kind")


def register_branch(
    name: str, build: LayerBuilder, help: str, *, positional: bool = False,
    per_block: bool = False,
) -> None:
    """Register a residual layer kind, usable in the model setting ``layers``.

    Every layer of that kind in a block recipe becomes ``ActNorm -> x + g(x)`` with
    ``g = build(config, encoding)``; ``build`` must return a
    :class:`~iresflow.nn.base.LipschitzBranch` certified below 1 (e.g. at ``config.coeff``).

    Args:
        name: The kind's name: lower-case letters, digits, ``-`` and ``_``, starting with a
            letter, not yet a layer kind.
        build: ``build(config, encoding) -> LipschitzBranch`` (:data:`LayerBuilder`).
        help: One line saying what the kind is.
        positional: Whether ``build`` takes the model's positional encoding (else ``None``).
        per_block: Whether ``build`` takes the index of its block as the keyword ``block``.

    Raises:
        TypeError: ``name`` or ``help`` is not a string, or ``build`` is not callable.
        ValueError: ``name`` is malformed or already a layer kind, or ``help`` is empty.

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> def wide_mlp(config, encoding):
        ...     return LipschitzMLP((config.features, 4 * config.hidden, config.features),
        ...                         coeff=config.coeff ** 0.5)
        >>> register_branch("wide-mlp", wide_mlp, "an MLP four times as wide")
        >>> "wide-mlp" in LAYERS.choices
        True
        >>> LAYERS.unregister("wide-mlp")
    """
    _register_layer(name, LayerKind(build, help, True, bool(positional), bool(per_block)))


def register_step(
    name: str, build: LayerBuilder, help: str, *, positional: bool = False,
    per_block: bool = False,
) -> None:
    """Register a step layer kind: an invertible step used in the chain as it is.

    Args:
        name: The kind's name: lower-case letters, digits, ``-`` and ``_``, starting with a
            letter, not yet a layer kind.
        build: ``build(config, encoding) -> SequenceTransform`` (:data:`LayerBuilder`); in a
            conditional model the step receives the context vector ``(B, C)``, with ``C =
            config.resolved_context_features``.
        help: One line saying what the kind is.
        positional: Whether ``build`` takes the model's positional encoding (else ``None``).
        per_block: Whether ``build`` takes the index of its block as the keyword ``block``.

    Raises:
        TypeError: ``name`` or ``help`` is not a string, or ``build`` is not callable.
        ValueError: ``name`` is malformed or already a layer kind, or ``help`` is empty.

    Example:
        >>> from iresflow.transforms.actnorm import ActNorm
        >>> register_step("scale", lambda config, encoding: ActNorm(config.features),
        ...               "a per-feature shift and scale")
        >>> LAYERS["scale"].residual
        False
        >>> LAYERS.unregister("scale")
    """
    _register_layer(name, LayerKind(build, help, False, bool(positional), bool(per_block)))


def _register_layer(name: str, kind: LayerKind) -> None:
    if not callable(kind.build):
        raise TypeError(f"build must be callable, got {type(kind.build).__name__}")
    if not isinstance(kind.help, str):
        raise TypeError(f"help must be a str, got {type(kind.help).__name__}")
    if not kind.help.strip():
        raise ValueError("help must say what the kind is, got an empty string")
    LAYERS.register(name, kind)
