"""Helpers of benchmarks/conditional.py: per-class likelihoods and the confusion matrix."""

from __future__ import annotations

import torch

from benchmarks.conditional import class_log_likelihoods, confusion_matrix
from iresflow.data.splits import SequenceSplit
from iresflow.models.transformer import ResidualFlowTransformer


def test_class_log_likelihoods_are_the_conditional_densities() -> None:
    model = ResidualFlowTransformer(features=2, max_len=4, n_blocks=1, hidden=8, ar_order=0,
                                    num_classes=3, logdet="exact").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "context_net" in name:
                p.copy_(torch.randn_like(p))
    x = torch.randn(5, 4, 2, dtype=torch.float64)
    mask = torch.arange(4)[None] < torch.tensor([4, 2, 3, 1, 4])[:, None]
    x = torch.where(mask[..., None], x, 0.0)
    split = SequenceSplit(x, mask, torch.zeros(5, dtype=torch.float64))
    scores = class_log_likelihoods(model, split, 3)
    assert scores.shape == (5, 3)
    for k in range(3):
        labels = torch.full((5,), k)
        expected = model.log_prob(x, mask, method="exact", context=labels)
        assert torch.allclose(scores[:, k], expected, atol=1e-10)
    assert not torch.allclose(scores[:, 0], scores[:, 1])


def test_confusion_matrix_counts() -> None:
    true, predicted = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, 2, 2, 2, 1])
    matrix = confusion_matrix(true, predicted, 3)
    assert matrix.tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 2]]
    assert int(matrix.trace()) == int((true == predicted).sum())
