"""Factories of a run: data subsets and the model built from the settings."""

from __future__ import annotations

import pytest
import torch

from iresflow.data.datasets import load_dataset
from iresflow.models.config import default_heads
from iresflow.models.transformer import ResidualFlowTransformer
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import (
    build_model,
    load_data,
    resolve_model_config,
)
from tests.tiny_runs import TINY


def test_load_data_limits_and_model_settings() -> None:
    config = TrainConfig(**TINY)
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
        build_model(config.replace(heads=5), dataset)
    with pytest.raises(ConfigError, match="max_len"):
        build_model(config.replace(max_len=10), dataset)
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_data(config.replace(data="no_such_data"))


def test_resolve_model_config_completes_settings_from_the_data() -> None:
    config = TrainConfig(**TINY)
    dataset = load_data(config)
    resolved = resolve_model_config(config, dataset)
    assert resolved == config.model.replace(
        features=dataset.features, max_len=dataset.max_len, heads=default_heads(dataset.features)
    )
    assert resolve_model_config(config.replace(max_len=40, heads=2), dataset).max_len == 40
    reference = ResidualFlowTransformer(**resolved.to_dict())
    assert build_model(config, dataset).state_dict().keys() == reference.state_dict().keys()
    with pytest.raises(ConfigError, match="features must be set"):
        ResidualFlowTransformer(config.model)
