"""Training configuration: one flat, typed record, read from and written to TOML.

A run is fully described by a :class:`TrainConfig`. The ``iresflow train`` command builds it from
an optional TOML file (flat ``key = value`` pairs, the keys are the field names below) and then
applies its command-line flags, which take precedence. The configuration is written back into the
run folder as ``config.toml`` and stored inside every checkpoint.

Options that mean "off" or "automatic" use ``0`` (``ema``, ``clip``, ``patience``) or are simply
omitted from the file (``heads``, ``max_len``, ``max_train``, ``max_eval``), so every setting has a
TOML spelling and ``TrainConfig.from_toml`` inverts :meth:`TrainConfig.to_toml` exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEVICE_PATTERN", "RESUMABLE_FIELDS", "ConfigError", "TrainConfig", "read_toml"]

# Settings that may change when a run is resumed; every other one must match the checkpoint.
RESUMABLE_FIELDS = frozenset(
    {"epochs", "patience", "device", "tensorboard", "max_eval", "on_nan"}
)

#: Accepted spellings of the ``device`` setting.
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class ConfigError(ValueError):
    """An invalid, unknown or unreadable training setting."""


def _opt(
    default: Any, help: str, choices: tuple[str, ...] | None = None, unset: str | None = None
) -> Any:
    """A field with its help text, its admissible values and the meaning of ``None``."""
    return field(default=default, metadata={"help": help, "choices": choices, "unset": unset})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run: data, model, optimisation, evaluation.

    Instances are immutable and validated on construction; :meth:`replace` returns a validated
    copy with some fields changed (this is how command-line flags override a file).

    Raises:
        ConfigError: a value has the wrong type or lies outside its range.

    Example:
        >>> config = TrainConfig(epochs=2, hidden=8)
        >>> TrainConfig.from_toml_string(config.to_toml()) == config
        True
        >>> config.replace(lr=1e-2).lr
        0.01
    """

    # data
    data: str = _opt("japanese_vowels", "dataset name or path to a .npz/.ts file")
    val_fraction: float = _opt(0.1, "fraction of the training sequences held out for validation")
    max_train: int | None = _opt(
        None, "use at most this many training sequences (smoke tests)", unset="all"
    )
    max_eval: int | None = _opt(
        None, "use at most this many validation and test sequences", unset="all"
    )
    # model
    n_blocks: int = _opt(8, "number of residual Transformer blocks")
    hidden: int = _opt(64, "hidden width of the feed-forward branches")
    heads: int | None = _opt(
        None, "attention heads, dividing the number of features",
        unset="the largest of 4, 3, 2, 1 that divides it",
    )
    coeff: float = _opt(0.9, "Lipschitz coefficient of every residual branch, in (0, 1)")
    attention: str = _opt("l2", "attention branch", ("l2", "lipschitznorm", "none"))
    positional: str = _opt("sinusoidal", "positional encoding", ("sinusoidal", "learned"))
    max_len: int | None = _opt(
        None, "longest sequence the model accepts", unset="the data's longest sequence"
    )
    n_power_iterations: int = _opt(
        1, "power iterations per step for spectral normalisation (with --spectral-norm power)"
    )
    spectral_norm: str = _opt(
        "exact", "spectral norm of the MLP layers in training", ("exact", "power")
    )
    logdet: str = _opt("roulette", "log-determinant used for training", ("exact", "roulette"))
    # optimisation
    optimizer: str = _opt("adam", "optimiser", ("adam", "adamw"))
    lr: float = _opt(6e-3, "learning rate")
    weight_decay: float = _opt(0.0, "weight decay")
    batch_size: int = _opt(8, "sequences per minibatch")
    epochs: int = _opt(60, "maximum number of epochs")
    scheduler: str = _opt(
        "cosine", "learning-rate schedule (plateau: halve on a stalled val NLL)",
        ("plateau", "cosine", "none"),
    )
    patience: int = _opt(10, "stop after this many epochs without a better val NLL (0: never)")
    ema: float = _opt(0.0, "decay of an exponential moving average of the weights (0: off)")
    clip: float = _opt(10.0, "clip the gradient norm to this value (0: off)")
    on_nan: str = _opt(
        "stop",
        "on a non-finite loss, gradient or validation NLL, or an inverse that stops converging: "
        "stop with a message, or skip (the step, or the epoch as a best candidate) with a warning",
        ("stop", "skip"),
    )
    nproc: int = _opt(
        1, "processes for data-parallel training (DDP: gloo on the CPU, nccl with one GPU each)"
    )
    seed: int = _opt(0, "seed of the data split, the initialisation and every random stream")
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto")
    # evaluation
    eval_method: str = _opt(
        "roulette", "log-determinant for validation and test", ("exact", "roulette")
    )
    eval_n_samples: int = _opt(
        4, "roulette estimates per sequence when eval_method is roulette (>= 2: standard error)"
    )
    tensorboard: bool = _opt(False, "also write TensorBoard event files")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name]))
            choices = f.metadata["choices"]
            if choices is not None and getattr(self, f.name) not in choices:
                raise ConfigError(
                    f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )
        _check_range("val_fraction", self.val_fraction, 0.0, 1.0)
        _check_range("coeff", self.coeff, 0.0, 1.0)
        _check_range("lr", self.lr, 0.0, math.inf)
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"ema must lie in [0, 1) (0: off), got {self.ema}")
        for name in ("weight_decay", "clip"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        for name in ("n_blocks", "hidden", "batch_size", "epochs", "n_power_iterations",
                     "eval_n_samples", "heads", "max_len", "max_train", "max_eval", "nproc"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.patience < 0:
            raise ConfigError(f"patience must be >= 0 (0: never stop early), got {self.patience}")
        if not DEVICE_PATTERN.match(self.device):
            raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if not self.data:
            raise ConfigError("data must name a dataset or a file")

    def replace(self, **changes: Any) -> TrainConfig:
        """Return a validated copy with ``changes`` applied.

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        _check_keys(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All settings as a plain dict (``None`` for automatic values)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build a configuration from a (possibly partial) dict of settings.

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        _check_keys(values)
        return cls(**values)

    def to_toml(self) -> str:
        """Serialise to a flat TOML document; automatic (``None``) settings are omitted."""
        lines = ["# iresflow training configuration"]
        for key, value in self.to_dict().items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = json.dumps(value, ensure_ascii=False)
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml_string(cls, text: str, source: str = "<string>") -> TrainConfig:
        """Parse a flat TOML document of settings.

        Raises:
            ConfigError: bad TOML, a nested table, an unknown key or an invalid value.
        """
        values = read_toml(text, source)
        tables = [key for key, value in values.items() if isinstance(value, dict)]
        if tables:
            raise ConfigError(
                f"{source}: expected flat key = value pairs, found table [{tables[0]}]"
            )
        try:
            return cls.from_dict(values)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        """Read a configuration file written by :meth:`save` or by hand.

        Raises:
            ConfigError: the file is missing, unreadable or invalid.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        return cls.from_toml_string(text, str(path))

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_toml` to ``path``."""
        Path(path).write_text(self.to_toml(), encoding="utf-8")

    def incompatible_fields(self, other: TrainConfig) -> list[str]:
        """Names of the settings, outside :data:`RESUMABLE_FIELDS`, in which two configs differ."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in RESUMABLE_FIELDS and getattr(self, f.name) != getattr(other, f.name)
        ]


def read_toml(text: str, source: str = "<string>") -> dict[str, Any]:
    """Parse TOML with :mod:`tomllib` (Python >= 3.11) or ``tomli``.

    Raises:
        ConfigError: invalid TOML, or Python 3.10 without ``tomli``.

    Example:
        >>> read_toml("lr = 1e-3")
        {'lr': 0.001}
    """
    if sys.version_info >= (3, 11):
        import tomllib as toml
    else:  # pragma: no cover - exercised on Python 3.10 only
        try:
            import tomli as toml
        except ImportError:
            raise ConfigError(
                "reading TOML on Python 3.10 needs the tomli package (pip install tomli)"
            ) from None
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as error:
        raise ConfigError(f"{source}: invalid TOML: {error}") from None


def _check_keys(values: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a field's type; integers are accepted for float fields."""
    if isinstance(hint, types.UnionType):
        if value is None:
            return None
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value}")
    if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
        raise ConfigError(f"{name} must be of type {hint.__name__}, got {value!r}")
    return value


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low < value < high:
        raise ConfigError(f"{name} must lie in ({low:g}, {high:g}), got {value}")
