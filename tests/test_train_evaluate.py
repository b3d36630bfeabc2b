"""Reloading a run: the stored model settings and the moving-average weights."""

from __future__ import annotations

from pathlib import Path

import torch

from iresflow.models.config import ModelConfig
from iresflow.train.averaging import load_average, moving_average
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import TrainConfig
from iresflow.train.evaluate import load_run
from iresflow.train.factories import load_data, resolve_model_config
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from tests.tiny_runs import TINY


def test_load_run_rebuilds_the_stored_model_with_averaged_weights(tmp_path: Path) -> None:
    config = TrainConfig(**TINY).replace(ema=0.5)
    train(config, tmp_path / "run", progress=False)
    state = load_checkpoint(RunPaths(tmp_path / "run").best)
    stored = ModelConfig.from_dict(state["model_config"])
    assert stored == resolve_model_config(config, load_data(config))
    assert (stored.features, stored.max_len, stored.heads) == (12, 29, 4)

    run = load_run(tmp_path / "run", device="cpu")
    average = moving_average(run.model, config.ema)
    load_average(average, state["ema"])
    averaged = dict(average.module.named_parameters())
    for name, parameter in run.model.named_parameters():
        assert torch.equal(parameter, averaged[name])
    # The averages differ from the trained weights, so the check above can fail.
    assert any(not torch.equal(state["model"][name], averaged[name]) for name in averaged)
    for name, buffer in run.model.named_buffers():
        assert torch.equal(buffer, state["model"][name])
