"""Whole splits through a flow: batched log-densities against one padded batch."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.data.splits import SequenceSplit
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.train.factories import build_model, load_data
from iresflow.train.likelihood import (
    batch_context,
    inverse_check,
    reconstructs,
    sharded_log_prob,
    split_log_prob,
    trimmed_batch,
    validation_method,
)
from tests.tiny_runs import TINY


def test_split_log_prob_matches_full_padded_batch() -> None:
    config = TINY
    dataset = load_data(config)
    torch.manual_seed(0)
    model = build_model(config, dataset)
    model.log_prob(dataset.train.x, dataset.train.mask)  # data-dependent ActNorm initialisation
    log_prob, stderr = split_log_prob(model, dataset.val, method="exact", batch_size=4)
    expected = model.log_prob(dataset.val.x, dataset.val.mask, method="exact").double()
    assert stderr is None and not model.training
    torch.testing.assert_close(log_prob, expected.detach(), rtol=1e-5, atol=1e-4)
    torch.manual_seed(1)
    estimate, stderr = split_log_prob(model, dataset.val, method="roulette", n_samples=3)
    assert stderr is not None and bool((stderr > 0).all())
    assert estimate.shape == stderr.shape == (len(dataset.val),)


def _conditional(**settings: object) -> tuple[ResidualSequenceFlow, SequenceSplit]:
    """A conditional model with a random context net, and labelled data with covariates."""
    model = ResidualSequenceFlow(features=2, max_len=4, n_blocks=1, hidden=8, ar_order=0,
                                    **settings).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "context_net" in name or "embedding" in name:
                p.copy_(torch.randn_like(p))
    x = torch.randn(6, 4, 2, dtype=torch.float64)
    mask = torch.arange(4)[None] < torch.tensor([4, 2, 3, 1, 4, 3])[:, None]
    split = SequenceSplit(torch.where(mask[..., None], x, 0.0), mask,
                          torch.zeros(6, dtype=torch.float64),
                          labels=torch.tensor([0, 1, 2, 0, 1, 2]),
                          covariates=torch.randn(6, 3, dtype=torch.float64))
    return model, split


def test_splits_are_scored_under_their_own_context() -> None:
    for settings, kind in (({"num_classes": 3}, "labels"), ({"context_features": 3}, "covariates")):
        model, split = _conditional(**settings)
        context = getattr(split, kind)
        expected = model.log_prob(split.x, split.mask, method="exact", context=context)
        log_prob, _ = split_log_prob(model, split, method="exact", batch_size=4)
        torch.testing.assert_close(log_prob, expected.detach())
        sharded, _ = sharded_log_prob(model, split, method="exact", batch_size=4)
        torch.testing.assert_close(sharded, expected.detach())
        shuffled = model.log_prob(split.x, split.mask, method="exact", context=context.roll(1, 0))
        assert not torch.allclose(log_prob, shuffled.double())  # the context matters
        assert inverse_check(model, split)["reconstruction_error"] < 1e-6


def test_batch_context_follows_the_model() -> None:
    model, split = _conditional(num_classes=3)
    index, cpu = torch.tensor([2, 4]), torch.device("cpu")
    assert batch_context(model, split, index, cpu).tolist() == [2, 1]
    assert batch_context(model, split, index, cpu, label=0).tolist() == [0, 0]
    covariate_model, _ = _conditional(context_features=3)
    assert torch.equal(batch_context(covariate_model, split, index, cpu), split.covariates[index])
    plain = ResidualSequenceFlow(features=2, max_len=4, n_blocks=1, hidden=8)
    assert batch_context(plain, split, index, cpu) is None
    with pytest.raises(ValueError, match="label-conditional"):
        batch_context(plain, split, index, cpu, label=0)
    with pytest.raises(ValueError, match="no labels"):
        batch_context(model, SequenceSplit(split.x, split.mask, split.log_jacobian), index, cpu)


def test_a_trimmed_batch_keeps_the_frames_after_a_gap() -> None:
    mask = torch.tensor([[True, False, True, False], [True, True, False, False]])
    split = SequenceSplit(mask.unsqueeze(-1).double(), mask, torch.zeros(2))
    x, trimmed = trimmed_batch(split, torch.tensor([0, 1]), torch.device("cpu"))
    assert trimmed.tolist() == [[True, False, True], [True, True, False]]
    assert x[:, :, 0].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]


def test_validation_method_resolves_auto_by_the_structure_of_the_flow() -> None:
    causal = ResidualSequenceFlow(features=2, max_len=6, n_blocks=1, hidden=4, causal=True)
    mixing = ResidualSequenceFlow(features=2, max_len=6, n_blocks=1, hidden=4)
    frames = ResidualSequenceFlow(features=2, max_len=6, n_blocks=1, hidden=4,
                                  layers=("mlp",))
    assert [validation_method(m, "auto") for m in (causal, mixing, frames)] == [
        "exact", "roulette", "exact"]
    for method in ("exact", "roulette"):
        assert validation_method(mixing, method) == validation_method(causal, method) == method
    assert validation_method(torch.nn.Linear(2, 2), "roulette") is None  # its own log_prob
    with pytest.raises(ValueError, match="eval_method must be auto, exact or roulette, got 'se"):
        validation_method(causal, "series")


def test_an_inverse_that_converges_but_does_not_reconstruct_is_flagged(monkeypatch) -> None:
    model, split = _conditional(num_classes=3)
    assert reconstructs(inverse_check(model, split))
    inverse = model.inverse
    monkeypatch.setattr(model, "inverse", lambda z, mask, **kw: inverse(z, mask, **kw) + 0.1)
    with pytest.warns(UserWarning, match="ill-conditioned, its samples are wrong"):
        row = inverse_check(model, split)
    assert row["reconstruction_error"] == pytest.approx(0.1, rel=1e-3)
    assert not reconstructs(row)
    assert reconstructs({"val_nll": 1.0})  # no check made: nothing to refuse
    assert not reconstructs({"reconstruction_error": math.inf})
    assert not reconstructs({"reconstruction_error": math.nan})
