"""What a run is made of: its device, its data and its model, built from a configuration.

:func:`build_model` is the one place a training configuration becomes a model: the model settings
of the run (:attr:`~iresflow.train.config.TrainConfig.model`) are completed from the data by
:func:`resolve_model_config` and handed to the model's constructor. It is also the one place that
names the concrete model class; the rest of the code sees a
:class:`~iresflow.models.flow.SequenceFlow`. A checkpoint stores the run's settings, from which
the same data and the same model are rebuilt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from iresflow._settings import check_device
from iresflow.data.datasets import SequenceDataset, SequenceSplit, load_dataset
from iresflow.data.store import StoredSplit
from iresflow.models.config import MAX_AUTO_AR_ORDER, ModelConfig
from iresflow.models.flow import SequenceFlow
from iresflow.models.reference import positionwise_evidence
from iresflow.models.residual_flow import ResidualSequenceFlow, input_order_nll
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import current_world

__all__ = [
    "build_model",
    "load_data",
    "resolve_device",
    "resolve_model_config",
]


def resolve_device(name: str) -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into an available device.

    In a process group on CUDA every process uses its own GPU, the one
    :func:`~iresflow.train.distributed.run_rank` pinned it to.

    Raises:
        ConfigError: an unknown device, or CUDA requested but not available.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    check_device(name)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and current_world().size > 1:  # one GPU per process
        return torch.device("cuda", torch.cuda.current_device())
    return device


def load_data(config: TrainConfig) -> SequenceDataset:
    """Load the dataset of a configuration, with random subsets of ``max_train``/``max_eval``.

    A ``test_data`` file becomes the test split (:func:`~iresflow.data.datasets.load_dataset`
    with ``test_path``); table data are read as the table settings say (``table``).

    Raises:
        ConfigError: unknown dataset, missing or malformed file (the message of
            :func:`~iresflow.data.datasets.load_dataset`).

    Example:
        >>> dataset = load_data(TrainConfig(max_train=10, max_eval=5))
        >>> len(dataset.train), len(dataset.val), len(dataset.test)
        (10, 5, 5)
    """
    try:
        dataset = load_dataset(
            config.data, seed=config.seed, val_fraction=config.val_fraction,
            test_path=config.test_data, memory_cap=config.memory_cap, table=config.table,
            dequantize=config.dequantize,
        )
    except (ValueError, OSError, ImportError) as error:
        raise ConfigError(f"cannot load dataset {config.data!r}: {error}") from None

    generator = torch.Generator().manual_seed(config.seed)

    def subset(
        split: SequenceSplit | StoredSplit, limit: int | None
    ) -> SequenceSplit | StoredSplit:
        # A random subset: the splits of some datasets are ordered (e.g. by speaker).
        if limit is None or limit >= len(split):
            return split
        return split.subset(torch.randperm(len(split), generator=generator)[:limit].sort().values)

    return dataclasses.replace(
        dataset,
        train=subset(dataset.train, config.max_train),
        val=subset(dataset.val, config.max_eval),
        test=subset(dataset.test, config.max_eval),
    )


def resolve_model_config(config: TrainConfig, dataset: SequenceDataset) -> ModelConfig:
    """The run's model settings completed from the data: the model a checkpoint stores.

    ``features`` is the dataset's, ``max_len`` the dataset's longest sequence unless set, and
    an automatic ``heads`` is fixed to its value for these features, an ``"auto"``
    ``position_norm`` to ``"on"`` or ``"off"`` and an automatic ``ar_order`` to an order by the
    validation evidence of the data (:func:`~iresflow.models.reference.positionwise_evidence`,
    :func:`~iresflow.models.residual_flow.input_order_nll`).
    The ``condition`` of the run sets the context: with ``"label"`` ``num_classes`` is the
    number of the dataset's classes, with ``"covariates"`` ``context_features`` is the width
    ``C`` of its covariates.

    Raises:
        ConfigError: settings the data rule out: ``max_len`` shorter than the longest
            sequence, heads that do not divide the number of features, a ``condition`` the data
            do not support (no labels or covariates in a split, e.g. a sequence-store folder),
            or ``num_classes`` / ``context_features`` set to other values than the data's.

    Example:
        >>> config = TrainConfig(model=ModelConfig(n_blocks=1, hidden=8))
        >>> resolved = resolve_model_config(config, load_data(config))
        >>> resolved.features, resolved.max_len, resolved.heads, resolved.hidden
        (12, 29, 4, 8)
    """
    model = config.model
    if model.max_len is not None and model.max_len < dataset.max_len:
        raise ConfigError(
            f"max_len={model.max_len} is shorter than the longest sequence of {dataset.name} "
            f"({dataset.max_len})"
        )
    try:
        model = model.replace(
            features=dataset.features,
            max_len=dataset.max_len if model.max_len is None else model.max_len,
            **_context_settings(config, dataset),
        )
    except ConfigError as error:
        raise ConfigError(f"incompatible model settings for {dataset.name}: {error}") from None
    return model.replace(heads=model.resolved_heads, **_input_settings(model, dataset))


def _input_settings(model: ModelConfig, dataset: SequenceDataset) -> dict[str, Any]:
    """``position_norm`` and ``ar_order`` of the input layers, automatic ones decided by the
    validation evidence of the data.

    An ``"auto"`` ``position_norm`` is ``"on"`` when
    :func:`~iresflow.models.reference.positionwise_evidence` of the training and validation
    splits favours standardising every position. An automatic ``ar_order`` is then the order
    whose input layers, fitted on the training split, score best on validation
    (:func:`~iresflow.models.residual_flow.input_order_nll`, orders 0 to
    :data:`~iresflow.models.config.MAX_AUTO_AR_ORDER`): small data get a low order instead of
    one that overfits them. Without a validation split held in memory (a sequence-store
    folder) they are ``"off"`` and :data:`~iresflow.models.config.DEFAULT_AR_ORDER`.
    """
    train, val = dataset.train, dataset.val
    in_memory = not (isinstance(train, StoredSplit) or isinstance(val, StoredSplit)
                     or not bool(val.mask.any()))
    position_norm = model.position_norm
    if position_norm == "auto":
        position_norm = "on" if in_memory and positionwise_evidence(train, val).favours else "off"
    ar_order = model.resolved_ar_order
    if model.ar_order is None and in_memory:
        nll = input_order_nll(train, val, MAX_AUTO_AR_ORDER, position_norm=position_norm == "on")
        ar_order = min(range(len(nll)), key=nll.__getitem__)
    return {"position_norm": position_norm, "ar_order": ar_order}


def _context_settings(config: TrainConfig, dataset: SequenceDataset) -> dict[str, int]:
    """``num_classes`` or ``context_features`` of the run's ``condition``, from the data."""
    if config.condition == "none":
        return {}
    kind = "labels" if config.condition == "label" else "covariates"
    splits = {"train": dataset.train, "val": dataset.val, "test": dataset.test}
    if any(isinstance(split, StoredSplit) for split in splits.values()):
        raise ConfigError(
            f"condition = {config.condition} needs {kind}, and a sequence-store folder "
            f"({dataset.name}) holds none: train on a .npz or .ts file instead"
        )
    missing = [name for name, split in splits.items() if getattr(split, kind) is None]
    if missing:
        source = (
            "class labels (japanese_vowels, the @classLabel of a .ts file, or y in an .npz file)"
            if kind == "labels" else "covariates (an array c in an .npz file)"
        )
        raise ConfigError(
            f"condition = {config.condition} needs {source} in every split, but the "
            f"{', '.join(missing)} split(s) of {dataset.name} have none"
        )
    if kind == "labels":
        name, value, what = "num_classes", len(dataset.classes or ()), "classes"
    else:
        name, value, what = "context_features", int(dataset.train.covariates.shape[1]), kind
    given = getattr(config.model, name)
    if given not in (0, value):
        raise ConfigError(
            f"{name} = {given} does not match the {value} {what} of {dataset.name} (leave it "
            "0: it is taken from the data)"
        )
    return {name: value}


def build_model(config: TrainConfig, dataset: SequenceDataset) -> SequenceFlow:
    """Construct the (untrained) flow of a configuration for a dataset.

    Raises:
        ConfigError: settings the data rule out (:func:`resolve_model_config`).

    Example:
        >>> config = TrainConfig(model=ModelConfig(n_blocks=1, hidden=8))
        >>> build_model(config, load_data(config)).max_len
        29
    """
    return ResidualSequenceFlow(resolve_model_config(config, dataset))
