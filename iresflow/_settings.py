"""Typed, validated settings records: one base, the field helper and the shared checks.

Every settings record (the model's, the training run's, those of evaluating, sampling and
inspecting a run) is a frozen dataclass subclassing :class:`SettingsRecord`, whose fields are
declared with :func:`setting`, which stores the help text, the admissible values and the meaning
of ``None`` next to the default. :func:`validate_fields` coerces and checks every field against
its type hint and choices, :func:`check_device` is the one check of a device name, so the
command line, TOML files and the Python API all go through the same checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import field
from typing import Any

__all__ = [
    "ConfigError",
    "SettingsRecord",
    "check_device",
    "check_keys",
    "check_minimum",
    "check_range",
    "setting",
    "validate_fields",
]


class ConfigError(ValueError):
    """An invalid, unknown or unreadable setting."""


def setting(
    default: Any, help: str, choices: tuple[str, ...] | None = None, unset: str | None = None
) -> Any:
    """A dataclass field with its help text, its admissible values and the meaning of ``None``.

    Args:
        default: Default value (``None`` for "automatic", explained by ``unset``).
        help: One-line description (used for ``--help`` and the docs).
        choices: Admissible string values, if the setting is a choice (for a list setting:
            the admissible values of its items).
        unset: What ``None`` means, for settings that may be left automatic.
    """
    return field(default=default, metadata={"help": help, "choices": choices, "unset": unset})


def validate_fields(record: Any) -> None:
    """Coerce every field of a frozen dataclass to its type hint and check its choices.

    Integers are accepted for ``float`` fields; floats must be finite; ``bool`` is not an
    ``int`` here.

    Raises:
        ConfigError: a value of the wrong type or outside its choices.
    """
    hints = typing.get_type_hints(type(record))
    for f in dataclasses.fields(record):
        value = _coerce(f.name, getattr(record, f.name), hints[f.name])
        object.__setattr__(record, f.name, value)
        choices = f.metadata.get("choices")
        items = value if isinstance(value, tuple) else (value,)
        if choices is not None and any(item not in choices for item in items):
            raise ConfigError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")


def check_keys(known: Iterable[str], values: dict[str, Any]) -> None:
    """Reject keys of ``values`` that are not ``known`` names of settings.

    Raises:
        ConfigError: naming the first unknown key and the known ones.

    Example:
        >>> check_keys(("lr", "epochs"), {"colour": 1})
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: unknown option 'colour' (known: epochs, lr)
    """
    known = set(known)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")


def check_range(name: str, value: float, low: float, high: float) -> None:
    """Require ``low < value < high``.

    Raises:
        ConfigError: naming the setting and the open interval.
    """
    if not low < value < high:
        raise ConfigError(f"{name} must lie in ({low:g}, {high:g}), got {value}")


#: Accepted spellings of a device setting.
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(value: str) -> None:
    """Require a device name that :func:`~iresflow.train.factories.resolve_device` accepts.

    Raises:
        ConfigError: anything but ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Example:
        >>> check_device("cuda:1")
        >>> check_device("tpu")
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: device must be cpu, cuda, cuda:N or auto, got 'tpu'
    """
    if not _DEVICE.match(value):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {value!r}")


def _coerce(name: str, value: Any, hint: Any) -> Any:
    if isinstance(hint, types.UnionType):
        if value is None:
            return None
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is tuple:
        if isinstance(value, list):
            value = tuple(value)
        (item,) = {arg for arg in typing.get_args(hint) if arg is not Ellipsis}
        if not isinstance(value, tuple) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{name} must be a list of {item.__name__}, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value}")
    if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
        raise ConfigError(f"{name} must be of type {hint.__name__}, got {value!r}")
    return value


class SettingsRecord:
    """Base of a frozen dataclass of settings: validated on construction, changed by copies.

    Subclasses declare their fields with :func:`setting` and add their own checks in
    :meth:`check`; :meth:`settings` lists the fields with their type hints, from which the
    command line derives one flag per setting and ``docs/cli.md`` its tables
    (:mod:`iresflow.settings_docs`). :meth:`to_dict` and :meth:`from_dict` are the plain-dict
    form (a record that embeds another one, like
    :class:`~iresflow.train.config.TrainConfig`, keeps that form flat).

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Draw(SettingsRecord):
        ...     num: int = setting(16, "sequences")
        >>> Draw().replace(num=3).num, Draw.from_dict({"num": 3}) == Draw(3)
        (3, True)
        >>> Draw(num="3")
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: num must be of type int, got '3'
    """

    def __post_init__(self) -> None:
        validate_fields(self)
        self.check()

    def check(self) -> None:
        """Checks beyond types and choices (ranges, combinations); raise :class:`ConfigError`."""

    @classmethod
    def settings(cls) -> list[tuple[dataclasses.Field, Any]]:
        """Every setting with its type hint, in the order of :meth:`to_dict`."""
        hints = typing.get_type_hints(cls)
        return [(f, hints[f.name]) for f in dataclasses.fields(cls)]

    def replace(self, **changes: Any) -> Any:
        """A validated copy with ``changes`` (fields of this record) applied.

        Raises:
            ConfigError: an unknown setting or an invalid value.
        """
        check_keys((f.name for f in dataclasses.fields(self)), changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, as plain values (``None`` for automatic ones)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Any:
        """A record from a (possibly partial) dict of settings; the others keep their defaults.

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        check_keys((f.name for f, _ in cls.settings()), values)
        return cls(**values)


def check_minimum(record: Any, names: Iterable[str], low: int) -> None:
    """Require every named field of ``record`` that is not ``None`` to be at least ``low``.

    Raises:
        ConfigError: naming the first field below ``low``.
    """
    for name in names:
        value = getattr(record, name)
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
