"""Factories of a run: data subsets and the model built from the settings."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from iresflow.data.datasets import SequenceSplit, load_dataset
from iresflow.data.store import write_store
from iresflow.models.config import DEFAULT_AR_ORDER, MAX_AUTO_AR_ORDER, ModelConfig, default_heads
from iresflow.models.distributions import StandardNormalSequence
from iresflow.models.flow import SequenceFlow
from iresflow.models.residual_flow import ResidualSequenceFlow, input_order_nll
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import (
    build_model,
    load_data,
    resolve_model_config,
)
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.temporal import AutoregressiveLinear
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
    nll = input_order_nll(dataset.train, dataset.val, MAX_AUTO_AR_ORDER)
    assert resolved == config.model.replace(
        features=dataset.features, max_len=dataset.max_len, heads=default_heads(dataset.features),
        position_norm="off",  # auto: twelve vowel recordings give no evidence for it
        ar_order=min(range(len(nll)), key=nll.__getitem__),
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


def _initial_val_nll(config: TrainConfig) -> float:
    """Validation NLL of the model training starts from (exact, after ``initialize``)."""
    dataset = load_data(config)
    torch.manual_seed(0)
    model = build_model(config, dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.initialize(dataset.train.x, dataset.train.mask)
    with torch.no_grad():
        log_prob = model.eval().log_prob(dataset.val.x, dataset.val.mask, method="exact")
    return dataset.nll(log_prob, dataset.val)


def test_an_automatic_ar_order_follows_the_amount_of_data() -> None:
    """Forty vowel recordings overfit an AR(3) input layer; the automatic order is lower, and
    the model training starts from is far better on validation than with AR(3)."""
    config = TrainConfig(max_train=40, max_eval=20, device="cpu",
                         model=ModelConfig(n_blocks=1, hidden=8))
    dataset = load_data(config)
    nll = input_order_nll(dataset.train, dataset.val, MAX_AUTO_AR_ORDER)
    chosen = resolve_model_config(config, dataset).ar_order
    assert chosen == min(range(len(nll)), key=nll.__getitem__) == 1
    assert nll[chosen] < nll[3] - 1.0
    fixed = config.replace(model=config.model.replace(ar_order=3))
    assert _initial_val_nll(config) < _initial_val_nll(fixed) - 1.0
    assert resolve_model_config(fixed, dataset).ar_order == 3  # an explicit order is kept
    # every training sequence: enough frames for the highest order
    assert resolve_model_config(config.replace(max_train=None), load_data(
        config.replace(max_train=None))).ar_order == MAX_AUTO_AR_ORDER


def test_input_order_nll_scores_the_initial_input_layers() -> None:
    """Order p's entry is the validation NLL of ActNorm then AR(p), initialised on train, under
    a standard normal base, computed here through a flow built from those layers."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 10, 2, generator=g, dtype=torch.float64).cumsum(1)
    mask = torch.ones(60, 10, dtype=torch.bool)
    mask[::3, 7:] = False
    x = torch.where(mask.unsqueeze(-1), x, 0.0)
    train, val = (SequenceSplit(x[a:b], mask[a:b], torch.zeros(b - a, dtype=torch.float64))
                  for a, b in ((0, 40), (40, 60)))
    nll = input_order_nll(train, val, 2)
    for order, value in enumerate(nll):
        steps = [ActNorm(2), *([AutoregressiveLinear(2, order)] if order else [])]
        flow = SequenceFlow(SequenceCompositeTransform(steps), StandardNormalSequence(2),
                            features=2).double()
        flow.initialize(train.x, train.mask)
        with torch.no_grad():
            expected = -float(flow.eval().log_prob(val.x, val.mask).sum() / val.mask.sum())
        assert value == pytest.approx(expected, rel=1e-12)
    assert nll[1] < nll[0]  # a random walk: the lag helps
    with pytest.raises(ValueError, match="real frame"):
        input_order_nll(train, SimpleNamespace(x=val.x, mask=torch.zeros_like(val.mask)), 1)


def test_a_store_falls_back_to_the_default_order(tmp_path: Path) -> None:
    lengths = torch.tensor([6, 5] * 20)
    write_store(tmp_path / "store", lengths, [torch.randn(int(n), 2) for n in lengths])
    config = TINY.replace(data=str(tmp_path / "store"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dataset = load_data(config)
    assert resolve_model_config(config, dataset).ar_order == DEFAULT_AR_ORDER
