"""Factories of a run: data subsets and the model built from the settings."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.data.datasets import load_dataset
from iresflow.data.store import write_store
from iresflow.models.config import ModelConfig, default_heads
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import (
    build_model,
    load_data,
    resolve_model_config,
)
from tests.tiny_runs import TINY


def test_load_data_limits_and_model_settings() -> None:
    config = TINY
    dataset = load_data(config)
    full = load_dataset("japanese_vowels", seed=0)
    assert (len(dataset.train), len(dataset.val), len(dataset.test)) == (12, 6, 6)
    for part, whole in ((dataset.train, full.train), (dataset.test, full.test)):
        # every kept sequence is one of the split's, with its own mask and log-Jacobian
        match = (part.x.flatten(1)[:, None] == whole.x.flatten(1)[None]).all(-1)
        index = match.float().argmax(1)
        assert bool(match.any(1).all()) and len(set(index.tolist())) == len(part)
        assert torch.equal(part.mask, whole.mask[index])
        assert torch.equal(part.log_jacobian, whole.log_jacobian[index])
    assert torch.equal(load_data(config).train.x, dataset.train.x)  # seeded
    assert not torch.equal(load_data(config.replace(seed=1)).train.x, dataset.train.x)
    with pytest.raises(ConfigError, match="heads must divide"):
        build_model(config.replace(model=config.model.replace(heads=5)), dataset)
    with pytest.raises(ConfigError, match="max_len"):
        build_model(config.replace(model=config.model.replace(max_len=10)), dataset)
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_data(config.replace(data="no_such_data"))


def test_resolve_model_config_completes_settings_from_the_data() -> None:
    config = TINY
    dataset = load_data(config)
    resolved = resolve_model_config(config, dataset)
    assert resolved == config.model.replace(
        features=dataset.features, max_len=dataset.max_len, heads=default_heads(dataset.features),
        position_norm="off",  # auto: twelve vowel recordings give no evidence for it
    )
    wider = config.replace(model=config.model.replace(max_len=40, heads=2))
    assert resolve_model_config(wider, dataset).max_len == 40
    reference = ResidualSequenceFlow(**resolved.to_dict())
    assert build_model(config, dataset).state_dict().keys() == reference.state_dict().keys()
    with pytest.raises(ConfigError, match="features must be set"):
        ResidualSequenceFlow(config.model)


def test_a_conditional_model_needs_a_condition() -> None:
    for settings in ({"num_classes": 3}, {"context_features": 2}):
        with pytest.raises(ConfigError, match="--condition"):
            TrainConfig(model=ModelConfig(**settings))
    with pytest.raises(ConfigError, match="condition = covariates takes no num_classes"):
        TrainConfig(condition="covariates", model=ModelConfig(num_classes=3))
    with pytest.raises(ConfigError, match="condition must be one of none, label, covariates"):
        TrainConfig(condition="labels")


def test_condition_label_takes_the_classes_of_the_data() -> None:
    config = TINY.replace(condition="label", model=TINY.model.replace(layers=("conv", "mlp")))
    dataset = load_data(config)
    resolved = resolve_model_config(config, dataset)
    assert resolved.num_classes == len(dataset.classes) == 9
    assert resolved.resolved_context_features == 8  # the automatic embedding size
    given = config.replace(model=config.model.replace(num_classes=9, context_features=4))
    assert resolve_model_config(given, dataset).context_features == 4
    with pytest.raises(ConfigError, match="num_classes = 5 does not match the 9 classes"):
        resolve_model_config(config.replace(model=config.model.replace(num_classes=5)), dataset)
    with pytest.raises(ConfigError, match="covariates .* japanese_vowels have none"):
        resolve_model_config(config.replace(condition="covariates"), dataset)
    unlabelled = TINY.replace(data="co2_windows", condition="label")
    with pytest.raises(ConfigError, match="class labels .* of co2_windows have none"):
        resolve_model_config(unlabelled, load_data(unlabelled))
    assert not resolve_model_config(config.replace(condition="none"), dataset).conditional


def test_condition_covariates_takes_their_width(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    path = tmp_path / "c.npz"
    np.savez(path, x=torch.randn(40, 5, 2, generator=generator).numpy(),
             c=torch.randn(40, 3, generator=generator).numpy())
    config = TINY.replace(data=str(path), condition="covariates")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # small splits
        dataset = load_data(config)
    resolved = resolve_model_config(config, dataset)
    assert (resolved.context_features, resolved.num_classes) == (3, 0)
    given = config.replace(model=config.model.replace(context_features=3))
    assert resolve_model_config(given, dataset) == resolved
    with pytest.raises(ConfigError, match="context_features = 2 does not match the 3 covariates"):
        resolve_model_config(config.replace(model=config.model.replace(context_features=2)),
                             dataset)
    with pytest.raises(ConfigError, match="class labels"):
        resolve_model_config(config.replace(condition="label"), dataset)


def test_a_sequence_store_cannot_be_conditioned(tmp_path: Path) -> None:
    lengths = torch.tensor([3, 2] * 20)
    write_store(tmp_path / "store", lengths, [torch.randn(int(n), 2) for n in lengths])
    config = TINY.replace(data=str(tmp_path / "store"), condition="label")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dataset = load_data(config)
    with pytest.raises(ConfigError, match="sequence-store folder .* holds none"):
        resolve_model_config(config, dataset)
