"""The per-position affine layer and its validation evidence: docs/math.md#positionwise-affine."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.data.datasets import SequenceSplit
from iresflow.data.store import write_store
from iresflow.models.reference import (
    EVIDENCE_LEVEL,
    AutoregressiveGaussian,
    positionwise_evidence,
)
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.runs.load import load_run
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import load_data, resolve_model_config
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from iresflow.transforms.positionwise import (
    RELATIVE_POSITION_VARIANCE_FLOOR,
    PositionwiseAffine,
    positionwise_moments,
)
from tests.oracles import jacobian_logdet
from tests.tiny_runs import TINY, forget_setting

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:.*fewer than 30:UserWarning")


def _mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def _randomised(features: int, max_len: int) -> PositionwiseAffine:
    layer = PositionwiseAffine(features, max_len).to(F64)
    with torch.no_grad():
        layer.shift.normal_()
        layer.log_scale.normal_(std=0.5)
    return layer.eval()


def _profile_split(num: int, length: int, generator: torch.Generator) -> SequenceSplit:
    """Sequences whose mean and spread depend on the position (a daily-profile-like law)."""
    t = torch.linspace(0, math.pi, length).view(1, length, 1)
    x = 3 * torch.sin(t) + (0.5 + t) * torch.randn(num, length, 1, generator=generator)
    return SequenceSplit(x, torch.ones(num, length, dtype=torch.bool), torch.zeros(num))


def _ar1_split(num: int, length: int, generator: torch.Generator) -> SequenceSplit:
    """A stationary AR(1): the law of a frame does not depend on its position."""
    x = torch.zeros(num, length, 1)
    x[:, 0] = torch.randn(num, 1, generator=generator) / math.sqrt(1 - 0.7**2)
    for t in range(1, length):
        x[:, t] = 0.7 * x[:, t - 1] + torch.randn(num, 1, generator=generator)
    return SequenceSplit(x, torch.ones(num, length, dtype=torch.bool), torch.zeros(num))


@pytest.mark.parametrize("lengths", [[4, 2, 1], [4, 4, 4]])
def test_logdet_matches_slogdet_and_the_inverse_undoes_it(lengths: list[int]) -> None:
    layer = _randomised(2, max_len=6)
    x = torch.randn(len(lengths), 4, 2, dtype=F64)
    mask = _mask(lengths, 4)
    y, logdet = layer(x, mask=mask)
    back, logdet_inverse = layer.inverse(y, mask=mask)
    torch.testing.assert_close(back, x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logdet_inverse, -logdet)
    assert torch.equal(y[~mask], x[~mask])  # padding passes through
    oracle = jacobian_logdet(lambda v, m: layer(v, mask=m)[0], x, mask)
    torch.testing.assert_close(logdet, oracle)


def test_padded_inputs_never_reach_real_outputs() -> None:
    layer = _randomised(3, max_len=5)
    x = torch.randn(2, 5, 3, dtype=F64)
    mask = _mask([5, 2], 5)
    changed = x.clone()
    changed[1, 2:] = 1e3
    for method in (layer.forward, layer.inverse):
        (a, la), (b, lb) = method(x, mask=mask), method(changed, mask=mask)
        assert torch.equal(a[mask], b[mask]) and torch.equal(la, lb)


def test_initialisation_standardises_every_position_of_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    split = _profile_split(50, 7, g)
    layer = PositionwiseAffine(1, max_len=9).to(F64)
    layer.initialize(split.x.double())
    y, _ = layer(split.x.double())
    torch.testing.assert_close(y.mean(0), torch.zeros(7, 1, dtype=F64), atol=1e-10, rtol=0)
    torch.testing.assert_close(y.var(0, unbiased=False), torch.ones(7, 1, dtype=F64))
    # the two positions no sequence reaches take the pooled moments of all frames
    frames = split.x.double().reshape(-1)
    torch.testing.assert_close(-layer.shift[7:, 0], frames.mean().expand(2))
    torch.testing.assert_close(torch.exp(-2 * layer.log_scale[7:, 0]),
                               frames.var(unbiased=False).expand(2))


def test_moments_floor_constant_positions_and_pool_rare_ones() -> None:
    x = torch.randn(6, 4, 2, dtype=F64)
    x[:, 0] = 5.0  # every sequence starts at the same value
    mask = _mask([4, 4, 4, 4, 4, 3], 4)
    mask[1:, 3] = False  # position 3 holds a single real frame
    mean, var = positionwise_moments(x, mask, max_len=6)
    real = x[mask]
    pooled_mean, pooled_var = real.mean(0), real.var(0, unbiased=False)
    torch.testing.assert_close(mean[0], torch.full((2,), 5.0, dtype=F64))
    torch.testing.assert_close(var[0], RELATIVE_POSITION_VARIANCE_FLOOR * pooled_var)
    torch.testing.assert_close(mean[3], pooled_mean)
    torch.testing.assert_close(var[3], pooled_var)
    torch.testing.assert_close(mean[1], x[:, 1].mean(0))
    assert mean.shape == var.shape == (6, 2)
    with pytest.raises(ValueError, match="max_len must be >= the sequence length 4"):
        positionwise_moments(x, mask, max_len=3)


def test_sequences_longer_than_max_len_are_refused_and_vectors_use_position_zero() -> None:
    layer = _randomised(2, max_len=3)
    with pytest.raises(ValueError, match="N=4 exceeds max_len=3 of PositionwiseAffine"):
        layer(torch.randn(1, 4, 2, dtype=F64))
    v = torch.randn(5, 2, dtype=F64)
    y, logdet = layer(v)
    torch.testing.assert_close(y, (v + layer.shift[0]) * layer.log_scale[0].exp())
    torch.testing.assert_close(logdet, layer.log_scale[0].sum().expand(5))


def test_evidence_favours_position_dependent_data_only() -> None:
    g = torch.Generator().manual_seed(1)
    profile = positionwise_evidence(_profile_split(40, 8, g), _profile_split(20, 8, g))
    assert profile.favours and profile.gain > 0 and profile.pvalue < EVIDENCE_LEVEL
    stationary = positionwise_evidence(_ar1_split(40, 8, g), _ar1_split(20, 8, g))
    assert not stationary.favours and stationary.sequences == 20
    # One wild validation sequence outweighs the others' gains in the mean, not in the ranks.
    val = _profile_split(20, 8, g)
    val.x[0, 0] += 200.0
    wild = positionwise_evidence(_profile_split(40, 8, g), val)
    assert wild.gain < 0 and wild.favours


def test_evidence_gain_is_the_likelihood_gain_through_the_layer() -> None:
    # Independent route: the fitted layer (its log-determinant checked above) in front of the
    # AR Gaussian fitted on its outputs; the plain AR Gaussian scores the frames directly.
    g = torch.Generator().manual_seed(2)
    train_split, val_split = _profile_split(30, 6, g), _profile_split(12, 6, g)
    evidence = positionwise_evidence(train_split, val_split, max_order=1)
    layer = PositionwiseAffine(1, max_len=6).to(F64)
    layer.initialize(train_split.x.double(), train_split.mask)
    layer.eval()
    with torch.no_grad():
        z_train, _ = layer(train_split.x.double())
        z_val, logdet = layer(val_split.x.double())
    scores = []
    for (tr, va) in ((z_train, z_val), (train_split.x.double(), val_split.x.double())):
        model = AutoregressiveGaussian(1, 6)
        full = torch.ones(tr.shape[:2], dtype=torch.bool)
        model.fit_selected_order(SequenceSplit(tr, full, torch.zeros(len(tr))),
                                 SequenceSplit(va, full[: len(va)], torch.zeros(len(va))), 1,
                                 refit=False)
        scores.append(model.log_prob(va))
    diff = scores[0] + logdet - scores[1]
    assert evidence.gain == pytest.approx(float(diff.mean()), rel=1e-9)
    # The one-sided signed-rank p-value by enumeration: the share of the 2^12 sign patterns of
    # the ranks of |gain| whose positive rank sum reaches the observed one (no ties here).
    ranks = diff.abs().argsort().argsort() + 1
    observed = int(ranks[diff > 0].sum())
    signs = torch.tensor(list(itertools.product((0, 1), repeat=12)))
    assert evidence.pvalue == pytest.approx(float(((signs @ ranks) >= observed).double().mean()),
                                            rel=1e-9)


def _npz(tmp_path: Path, split: SequenceSplit) -> str:
    path = tmp_path / "profiles.npz"
    np.savez(path, x=split.x.numpy())
    return str(path)


def test_auto_decides_from_the_data_and_the_run_records_the_decision(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    profiles = TINY.replace(max_train=None, max_eval=None,
                            data=_npz(tmp_path, _profile_split(120, 8, g)))
    assert profiles.model.position_norm == "auto"
    model = resolve_model_config(profiles, load_data(profiles))
    assert model.position_norm == "on"
    names = [name for name, _ in ResidualSequenceFlow(model).transform.named_steps()]
    assert names[:2] == ["input.positionwise", "input.autoregressive"]
    off = ResidualSequenceFlow(model.replace(position_norm="off"))
    assert [name for name, _ in off.transform.named_steps()][:2] == ["input.actnorm",
                                                                     "input.autoregressive"]
    assert ResidualSequenceFlow(model.replace(position_norm="auto")).state_dict().keys() \
        == off.state_dict().keys()  # a model built without data: off
    train(profiles, tmp_path / "run", progress=False)
    assert 'position_norm = "on"' in RunPaths(tmp_path / "run").config.read_text()
    run = load_run(tmp_path / "run", device="cpu")
    assert isinstance(next(run.model.transform.named_steps())[1], PositionwiseAffine)
    vowels = TINY
    assert resolve_model_config(vowels, load_data(vowels)).position_norm == "off"
    with pytest.raises(ConfigError, match="position_norm"):
        TrainConfig.from_dict({"position_norm": "yes"})


def test_a_sequence_store_is_never_standardised_per_position(tmp_path: Path) -> None:
    lengths = torch.tensor([6] * 40)
    write_store(tmp_path / "store", lengths, [torch.randn(6, 1) + torch.arange(6.0).view(6, 1)
                                              for _ in lengths])
    config = TINY.replace(data=str(tmp_path / "store"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dataset = load_data(config)
    assert resolve_model_config(config, dataset).position_norm == "off"


def test_a_run_written_before_position_norm_loads_without_the_layer(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    train(TINY.replace(model=TINY.model.replace(position_norm="off")), folder, progress=False)
    paths = forget_setting(folder, "position_norm")
    assert TrainConfig.from_toml(paths.config, stored=True).model.position_norm == "off"
    run = load_run(folder, device="cpu")
    assert not any(isinstance(m, PositionwiseAffine) for m in run.model.modules())
