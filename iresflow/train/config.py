"""Training configuration: one typed record, read from and written to flat TOML.

A run is fully described by a :class:`TrainConfig`. Its model settings are a
:class:`~iresflow.models.config.ModelConfig` (the single definition of every model default), the
field :attr:`TrainConfig.model`; the data, optimisation and evaluation settings are its own
fields. In Python the nesting is explicit: ``TrainConfig(model=ModelConfig(n_blocks=2),
lr=1e-3)``, ``config.model.hidden``, ``config.replace(model=config.model.replace(hidden=8))``.
Serialised, both kinds are spelled alike: flat ``key = value`` pairs in TOML (``n_blocks = 8``,
``lr = 0.005``), a flat dict (:meth:`TrainConfig.to_dict`, :meth:`TrainConfig.from_dict`, the
form a checkpoint stores) and flags on the command line (``--n-blocks 2``). ``features`` is not a
setting of a run: it comes from the data.

The ``iresflow train`` command builds the configuration from an optional TOML file and then
applies its command-line flags, which take precedence: flat settings change a configuration
through its flat form, ``TrainConfig.from_dict({**config.to_dict(), **flat})``. The configuration
is written back into the run folder as ``config.toml`` and stored inside every checkpoint.

Options that mean "off" or "automatic" use ``0`` (``ema``, ``clip``, ``warmup``, ``patience``) or
are simply omitted from the file (``val_fraction``, ``test_data``, ``heads``, ``max_len``,
``max_train``, ``max_eval``), so every setting has a TOML spelling and
``TrainConfig.from_toml`` inverts :meth:`TrainConfig.to_toml` exactly. A run writes the
automatic ``val_fraction`` it used into its ``config.toml``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iresflow._settings import (
    ConfigError,
    SettingsRecord,
    check_device,
    check_keys,
    check_minimum,
    check_range,
    setting,
)
from iresflow.data.partition import MAX_VAL_FRACTION, MIN_VAL_SEQUENCES, VAL_FRACTION
from iresflow.data.quantization import DEQUANTIZE_CHOICES
from iresflow.data.tables import TABLE_SETTINGS, TableLayout
from iresflow.data.user_files import USER_FILE_SUFFIXES, user_file_kind
from iresflow.models.config import ModelConfig

__all__ = [
    "MODEL_SETTINGS",
    "NESTED",
    "RESUMABLE_FIELDS",
    "USER_FILE_SUFFIXES",
    "ConfigError",
    "TrainConfig",
    "read_toml",
]

# Settings that may change when a run is resumed; every other one must match the checkpoint.
RESUMABLE_FIELDS = frozenset(
    {"epochs", "max_seconds", "patience", "device", "tensorboard", "max_eval", "on_nan",
     "memory_cap"}
)

#: The model settings of a run: every :class:`~iresflow.models.config.ModelConfig` field but
#: ``features``, which comes from the data.
MODEL_SETTINGS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "features")

#: The records a run nests, by field, with the names of their settings in the flat form (TOML,
#: flags, :meth:`TrainConfig.to_dict`): the model's (:data:`MODEL_SETTINGS`) and the layout of
#: table data.
NESTED: dict[str, tuple[type[SettingsRecord], tuple[str, ...]]] = {
    "model": (ModelConfig, MODEL_SETTINGS),
    "table": (TableLayout, TABLE_SETTINGS),
}

#: Settings added after runs were first written, with the value that reproduces such a run: the
#: noise density was standard normal before ``base`` existed, no layer was per position before
#: ``position_norm``, an epoch was one pass over the training split before ``min_steps``,
#: overlapping table windows were split at random before ``window_split``, data were read as
#: they are before ``dequantize``, a run trained one model before ``alternative``, and the cosine
#: schedule annealed over all epochs before ``anneal``.
SETTINGS_BEFORE_THEY_EXISTED: dict[str, Any] = {"base": "normal", "position_norm": "off",
                                                "min_steps": 1, "window_split": "random",
                                                "dequantize": "off", "alternative": "none",
                                                "anneal": 0}


@dataclass(frozen=True)
class TrainConfig(SettingsRecord):
    """Every setting of a training run: data, model, optimisation, evaluation.

    Instances are immutable and validated on construction; :meth:`replace` returns a validated
    copy with some fields changed. The model settings are the field ``model``, a
    :class:`~iresflow.models.config.ModelConfig` whose ``features`` is left ``None`` (it comes
    from the data). The flat form (:meth:`to_dict`, :meth:`from_dict`, TOML, the flags) spells
    the model settings (:data:`MODEL_SETTINGS`) as keys of their own, beside the others.

    Raises:
        ConfigError: an unknown setting, or a value of the wrong type or outside its range.

    Example:
        >>> config = TrainConfig(model=ModelConfig(hidden=8), epochs=2)
        >>> config.model.hidden, config.to_dict()["hidden"]
        (8, 8)
        >>> TrainConfig.from_toml_string(config.to_toml()) == config
        True
        >>> config.replace(model=config.model.replace(n_blocks=1)).model.n_blocks
        1
        >>> TrainConfig.from_dict({**config.to_dict(), "hidden": 16, "lr": 1e-2}).model.hidden
        16
    """

    # data
    data: str = setting(
        "japanese_vowels", "dataset name (docs/datasets.md), path to a .npz, .ts, .csv or "
        ".parquet file, or a sequence-store folder"
    )
    val_fraction: float | None = setting(
        None, "fraction of the training sequences held out for validation",
        unset=f"{VAL_FRACTION:g}, raised so that validation holds {MIN_VAL_SEQUENCES} sequences "
        f"but at most {MAX_VAL_FRACTION:g} of them; a run records the fraction it used",
    )
    test_data: str | None = setting(
        None,
        "test file of data given as a file, in its format (e.g. the _TEST.ts of a UEA _TRAIN.ts)",
        unset="10% of the data file",
    )
    # table data (.csv, .parquet; docs/datasets.md#tables): the defaults, help texts and checks
    # are TableLayout's
    table: TableLayout = field(default_factory=TableLayout)
    dequantize: str = setting(
        "auto", "features of data files whose values repeat on a regular grid (counts, rounded "
        "readings) get uniform noise of one grid step, so that their density is a proper score "
        "(docs/datasets.md#quantised); off: the values as read", DEQUANTIZE_CHOICES,
    )
    max_train: int | None = setting(
        None, "use at most this many training sequences (smoke tests)", unset="all"
    )
    max_eval: int | None = setting(
        None, "use at most this many validation and test sequences", unset="all"
    )
    condition: str = setting(
        "none", "condition the flow on the data's class labels or per-sequence covariates",
        ("none", "label", "covariates"),
    )
    # model: the defaults, help texts and checks are ModelConfig's
    model: ModelConfig = field(default_factory=ModelConfig)
    alternative: str = setting(
        "auto", "models trained after the configured one on the same split; the run keeps "
        "whichever reaches the lowest validation NLL (docs/guide.md#model-selection). "
        "recurrent: these settings with layers autoregressive,conv,mlp, conditioner gru and lr "
        "0.001; maf: layers maf,maf, conditioner gru, ar_order 0, optimizer adamw, lr 0.003, "
        "weight_decay 0.05; none: the configured model only; auto: when layers is left at its "
        "default, recurrent, and maf too for frames of more than one feature, else none",
        ("auto", "recurrent", "maf", "none"),
    )
    # optimisation
    optimizer: str = setting("adam", "optimiser", ("adam", "adamw"))
    lr: float = setting(5e-3, "learning rate")
    weight_decay: float = setting(0.0, "weight decay")
    batch_size: int = setting(32, "sequences per minibatch")
    epochs: int = setting(
        1000, "most epochs: a cap for runs whose validation NLL keeps improving; training ends "
        "earlier by patience or max_seconds (docs/cli.md#epochs)"
    )
    min_steps: int = setting(
        16, "fewest optimiser steps of an epoch: a training split of fewer batches is passed over "
        "as many times as that takes, each pass a fresh shuffle, so small data get enough steps "
        "between two validations (1: one pass per epoch; docs/cli.md#epochs)"
    )
    max_seconds: float = setting(
        3600.0, "time budget: stop after this many seconds of optimisation in total "
        "(validation excluded), checked after every step; the epoch cut short is validated as "
        "usual (0: no limit)"
    )
    scheduler: str = setting(
        "cosine", "learning-rate schedule after the warm-up (plateau: halve lr on a stalled val "
        "NLL; cosine: anneal it to a floor by epoch anneal, then keep the floor; none: keep it)",
        ("plateau", "cosine", "none"),
    )
    anneal: int = setting(
        60, "with scheduler cosine: the epoch (warm-up included) by which lr has annealed to "
        "0.01 lr; training goes on at that floor while the validation NLL improves (0: over all "
        "epochs)"
    )
    warmup: int = setting(
        2,
        "epochs of linear learning-rate warm-up, step by step: with W optimiser steps in these "
        "epochs, step k runs at k lr / (W + 1), the first at lr / (W + 1), the step after them at "
        "lr (0: off)",
    )
    patience: int = setting(
        10,
        "stop after this many counted epochs without a better val NLL (0: never); epochs are "
        "counted after the warm-up, and with the cosine schedule once lr has annealed to half",
    )
    ema: float = setting(
        0.0, "decay of an exponential moving average of the weights, used for validation, test "
        "and sampling (0: off)"
    )
    clip: float = setting(10.0, "clip the gradient norm to this value (0: off)")
    on_nan: str = setting(
        "stop",
        "on a non-finite loss, gradient or validation NLL, or an inverse that stops converging: "
        "stop with a message, or skip (the step, or the epoch as a best candidate) with a warning",
        ("stop", "skip"),
    )
    nproc: int = setting(
        1, "processes for data-parallel training (DDP: gloo on the CPU, nccl with one GPU each)"
    )
    seed: int = setting(0, "seed of the data split, the initialisation and every random stream")
    device: str = setting("auto", "cpu, cuda, cuda:N or auto (CUDA when available)")
    # evaluation
    eval_method: str = setting(
        "auto", "log-determinant of the validation NLL after every epoch (auto: exact when it "
        "splits by frames, as in a causal flow, else roulette)", ("auto", "exact", "roulette"),
    )
    eval_n_samples: int = setting(
        4,
        "roulette estimates per sequence for the validation NLL when eval_method is roulette, "
        "and of the pilot of the final test NLL (>= 2: standard error)",
    )
    tensorboard: bool = setting(False, "also write TensorBoard event files")
    # data larger than memory (docs/scaling.md)
    bucket: int = setting(
        0, "sort the sequences by length within windows of this many batches, so batches hold "
        "similar lengths and little padding (0: plain shuffle; docs/scaling.md)"
    )
    memory_cap: int = setting(
        0, "with a sequence-store folder as data: megabytes its memory map may keep resident "
        "before it is re-opened, bounding the memory the data occupy (0: no cap; "
        "docs/scaling.md)"
    )

    def check(self) -> None:
        if self.model.features is not None:
            raise ConfigError(
                f"model.features must be left unset (it comes from the data), got "
                f"{self.model.features}"
            )
        if self.val_fraction is not None:
            check_range("val_fraction", self.val_fraction, 0.0, 1.0)
        check_range("lr", self.lr, 0.0, math.inf)
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"ema must lie in [0, 1) (0: off), got {self.ema}")
        for name in ("weight_decay", "clip", "max_seconds"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        for name in ("bucket", "memory_cap"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        check_minimum(
            self, ("batch_size", "epochs", "min_steps", "eval_n_samples", "max_train", "max_eval",
                   "nproc"), 1
        )
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0 epochs (0: off), got {self.warmup}")
        if self.anneal < 0:
            raise ConfigError(f"anneal must be >= 0 epochs (0: over all epochs), got {self.anneal}")
        if self.patience < 0:
            raise ConfigError(f"patience must be >= 0 (0: never stop early), got {self.patience}")
        check_device(self.device)
        if not self.data:
            raise ConfigError("data must name a dataset or a file")
        self._validate_condition()
        if self.test_data is not None:
            kinds = [user_file_kind(getattr(self, name)) for name in ("data", "test_data")]
            for name, kind in zip(("data", "test_data"), kinds, strict=True):
                if kind is None:
                    raise ConfigError(
                        f"test_data needs data and test_data to be .npz or .ts files, or tables "
                        f"(.csv, .parquet), got {name} = {getattr(self, name)!r}"
                    )
            if kinds[0] != kinds[1]:
                raise ConfigError(f"test_data = {self.test_data!r} is not a file of the kind of "
                                  f"data = {self.data!r}")
        given = self.table.given()
        if given and user_file_kind(self.data) != "table":
            name = given[0]
            raise ConfigError(f"{name} is a setting of table data (a .csv or .parquet file), "
                              f"not of data = {self.data!r}")

    def _validate_condition(self) -> None:
        """The model's context settings against ``condition`` (those the data decide are checked
        by :func:`~iresflow.train.factories.resolve_model_config`)."""
        model = self.model
        if self.condition == "none" and model.conditional:
            name = "num_classes" if model.num_classes > 0 else "context_features"
            raise ConfigError(
                f"{name} = {getattr(model, name)} makes a conditional model: choose what it is "
                "conditioned on with condition = label or covariates (--condition)"
            )
        if self.condition == "covariates" and model.num_classes > 0:
            raise ConfigError(
                f"condition = covariates takes no num_classes, got {model.num_classes} (use "
                "condition = label for class labels)"
            )

    @classmethod
    def settings(cls) -> list[tuple[dataclasses.Field, Any]]:
        """Every flat setting with its type hint, in the order of :meth:`to_dict`: the settings
        of a nested record (:data:`NESTED`: the model's, the table layout's) in place of its
        field.

        They are the fields of those records themselves (default, help text, choices), so the
        command line derives its flags from one definition.

        Example:
            >>> names = [f.name for f, _ in TrainConfig.settings()]
            >>> tuple(names[11:14])
            ('max_eval', 'condition', 'max_len')
        """
        hints = typing.get_type_hints(cls)
        result: list[tuple[dataclasses.Field, Any]] = []
        for f in dataclasses.fields(cls):
            if f.name in NESTED:
                record, names = NESTED[f.name]
                result.extend((g, hint) for g, hint in record.settings() if g.name in names)
            else:
                result.append((f, hints[f.name]))
        return result

    def to_dict(self) -> dict[str, Any]:
        """All settings as a flat, plain dict (``None`` for automatic values)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in NESTED:
                nested = getattr(self, f.name).to_dict()
                values.update((name, nested[name]) for name in NESTED[f.name][1])
            else:
                values[f.name] = getattr(self, f.name)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, stored: bool = False) -> TrainConfig:
        """Build a configuration from a (possibly partial) flat dict of settings.

        Args:
            values: Settings by name, those of the nested records (:data:`NESTED`) among them;
                the others keep their defaults.
            stored: The settings of an existing run (its ``config.toml`` or checkpoint): a
                setting it lacks was added after the run was written, and takes the value
                that reproduces the run (:data:`SETTINGS_BEFORE_THEY_EXISTED`), not today's
                default.

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        if stored:
            values = {**SETTINGS_BEFORE_THEY_EXISTED, **values}
        check_keys((f.name for f, _ in cls.settings()), values)
        nested = {field: record(**{name: values[name] for name in names if name in values})
                  for field, (record, names) in NESTED.items()}
        flat = {name for _, names in NESTED.values() for name in names}
        own = {name: value for name, value in values.items() if name not in flat}
        return cls(**own, **nested)

    def to_toml(self) -> str:
        """Serialise to a flat TOML document; automatic (``None``) settings are omitted."""
        lines = ["# iresflow training configuration"]
        for key, value in self.to_dict().items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (str, tuple)):  # a JSON string or list of strings is TOML
                text = json.dumps(list(value) if isinstance(value, tuple) else value,
                                  ensure_ascii=False)
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml_string(cls, text: str, source: str = "<string>", *,
                         stored: bool = False) -> TrainConfig:
        """Parse a flat TOML document of settings (``stored``: as in :meth:`from_dict`).

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
            return cls.from_dict(values, stored=stored)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    @classmethod
    def from_toml(cls, path: str | Path, *, stored: bool = False) -> TrainConfig:
        """Read a configuration file written by :meth:`save` or by hand (``stored``: a run's
        own file, as in :meth:`from_dict`).

        Raises:
            ConfigError: the file is missing, unreadable or invalid.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        return cls.from_toml_string(text, str(path), stored=stored)

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_toml` to ``path``."""
        Path(path).write_text(self.to_toml(), encoding="utf-8")

    def incompatible_fields(self, other: TrainConfig) -> list[str]:
        """Names of the settings, outside :data:`RESUMABLE_FIELDS`, in which two configs differ."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [
            name for name in mine if name not in RESUMABLE_FIELDS and mine[name] != theirs[name]
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
