"""Whole splits through a flow: batched log-densities against one padded batch."""

from __future__ import annotations

import torch

from iresflow.train.config import TrainConfig
from iresflow.train.factories import build_model, load_data
from iresflow.train.likelihood import split_log_prob
from tests.tiny_runs import TINY


def test_split_log_prob_matches_full_padded_batch() -> None:
    config = TrainConfig(**TINY)
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
