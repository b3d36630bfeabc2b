"""Generative classification (iresflow.runs.classify): per-class likelihoods, Bayes' rule."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.data.splits import SequenceSplit
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.runs.classify import (
    bayes_classify,
    class_log_likelihoods,
    class_prior,
    confusion_matrix,
)


def _labelled(batch: int = 5) -> tuple[ResidualSequenceFlow, SequenceSplit]:
    """A label-conditional model whose context net is random (classes give distinct densities)."""
    model = ResidualSequenceFlow(features=2, max_len=4, n_blocks=1, hidden=8, ar_order=0,
                                    num_classes=3, logdet="exact").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "context_net" in name:
                p.copy_(torch.randn_like(p))
    x = torch.randn(batch, 4, 2, dtype=torch.float64)
    mask = torch.arange(4)[None] < torch.randint(1, 5, (batch,))[:, None]
    x = torch.where(mask[..., None], x, 0.0)
    labels = torch.randint(3, (batch,))
    return model, SequenceSplit(x, mask, torch.zeros(batch, dtype=torch.float64), labels)


def test_class_log_likelihoods_are_the_conditional_densities() -> None:
    model, split = _labelled()
    scores = class_log_likelihoods(model, split, batch_size=2)
    assert scores.shape == (5, 3) and scores.dtype == torch.float64
    for k in range(3):
        expected = model.log_prob(split.x, split.mask, method="exact",
                                  context=torch.full((5,), k))
        assert torch.allclose(scores[:, k], expected, atol=1e-10)
    assert not torch.allclose(scores[:, 0], scores[:, 1])


def test_roulette_class_scores_share_their_draws_and_are_reproducible() -> None:
    model, split = _labelled()
    first = class_log_likelihoods(model, split, method="roulette", n_samples=2, seed=3)
    again = class_log_likelihoods(model, split, method="roulette", n_samples=2, seed=3)
    assert torch.equal(first, again)
    exact = class_log_likelihoods(model, split)
    assert (first - exact).abs().max() < 1.0  # unbiased estimates of a small flow are close


def test_class_log_likelihoods_refuse_an_unconditional_model() -> None:
    model = ResidualSequenceFlow(features=2, max_len=4, n_blocks=1, hidden=8)
    _, split = _labelled()
    with pytest.raises(ValueError, match="label-conditional"):
        class_log_likelihoods(model, split)


def test_bayes_rule_adds_the_log_prior() -> None:
    scores = torch.tensor([[-1.0, -1.5], [-2.0, -1.9]], dtype=torch.float64)
    assert bayes_classify(scores, torch.tensor([0.5, 0.5])).tolist() == [0, 1]
    # log(0.2) - log(0.8) = -1.39 moves the first sequence to class 1, not the second to class 0
    assert bayes_classify(scores, torch.tensor([0.2, 0.8])).tolist() == [1, 1]
    assert bayes_classify(scores, torch.tensor([1.0, 0.0])).tolist() == [0, 0]
    with pytest.raises(ValueError, match="prior"):
        bayes_classify(scores, torch.ones(3) / 3)


def test_class_prior_is_the_label_frequency() -> None:
    prior = class_prior(torch.tensor([2, 0, 2, 2]), 4)
    assert prior.tolist() == [0.25, 0.0, 0.75, 0.0]
    assert math.isclose(float(prior.sum()), 1.0)


def test_confusion_matrix_counts() -> None:
    true, predicted = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, 2, 2, 2, 1])
    matrix = confusion_matrix(true, predicted, 3)
    assert matrix.tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 2]]
    assert int(matrix.trace()) == int((true == predicted).sum())
