"""Figures of a run: PNG files and input checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iresflow.runs.plots import (
    PlotLabels,
    plot_fan,
    plot_frame_scores,
    plot_learning_curves,
    plot_marginals,
    plot_traces,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plots_write_png_files(tmp_path: Path) -> None:
    real = torch.randn(3, 6, 5)
    mask = torch.arange(6) < torch.tensor([[6], [4], [2]])
    real = torch.where(mask.unsqueeze(-1), real, 0.0)
    rows = [
        {"epoch": 1, "train_nll": 2.0, "val_nll": 2.2, "val_nll_stderr": 0.1, "lr": 1e-3},
        {"epoch": 2, "train_nll": 1.5, "val_nll": 1.9, "val_nll_stderr": 0.1, "lr": 5e-4},
    ]
    written = [
        plot_learning_curves(rows, tmp_path / "curves.png"),
        plot_traces(real, mask, real[:2], mask[:2], tmp_path / "traces.png"),
        plot_marginals(real, mask, real[:2], mask[:2], tmp_path / "sub" / "marginals.png"),
    ]
    for path in written:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="same number of features"):
        plot_traces(real, mask, real[..., :2], mask, tmp_path / "x.png")
    with pytest.raises(TypeError, match="real_mask"):
        plot_marginals(real, None, real, mask, tmp_path / "x.png")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one epoch"):
        plot_learning_curves([], tmp_path / "x.png")


def test_plot_labels_and_options(tmp_path: Path) -> None:
    assert PlotLabels.for_dataset("japanese_vowels").feature.format(index=3) == (
        "LPC cepstrum coefficient 3"
    )
    assert PlotLabels.for_dataset("co2_windows").value == "CO2 change (ppm/week)"
    assert PlotLabels.for_dataset("motion_TRAIN.ts") == PlotLabels(data="motion_TRAIN.ts")
    rows = [{"epoch": e, "train_nll": 1.0 / e, "val_nll": 1.0 + e, "lr": 1e-3} for e in (1, 2)]
    assert plot_learning_curves(rows, tmp_path / "c.png", best_epoch=1).is_file()
    with pytest.raises(ValueError, match="best_epoch 3 is not an epoch"):
        plot_learning_curves(rows, tmp_path / "c.png", best_epoch=3)
    # gaps inside sequences (missing frames) and any number of samples
    x = torch.randn(2, 6, 1)
    mask = torch.tensor([[True, False, True, True, True, False], [True] * 6])
    x = torch.where(mask.unsqueeze(-1), x, 0.0)
    labels = PlotLabels(time="day", value="temperature (°C)", feature="station", data="toy")
    path = plot_traces(x, mask, x, mask, tmp_path / "t.png", labels=labels, max_sequences=1)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="max_sequences must be >= 1"):
        plot_traces(x, mask, x, mask, tmp_path / "t.png", max_sequences=0)


def test_fan_chart_and_frame_scores_write_png_files_and_check_inputs(tmp_path: Path) -> None:
    past, draws = torch.randn(7, 3), torch.randn(40, 4, 3)
    mask = torch.tensor([True, True, False, True, True, True, True])
    past = torch.where(mask.unsqueeze(-1), past, 0.0)
    truth, truth_mask = torch.randn(4, 3), torch.tensor([True, True, False, True])
    written = [
        plot_fan(past, mask, draws, 7, tmp_path / "fan.png", truth=truth, truth_mask=truth_mask),
        plot_frame_scores(past, mask, torch.where(mask, torch.rand(7), torch.nan),
                          tmp_path / "frames.png", title="sequence 3"),
    ]
    for path in written:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="same number of features"):
        plot_fan(past, mask, draws[..., :2], 7, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"nll must be a tensor of shape \(N,\) = \(7,\)"):
        plot_frame_scores(past, mask, torch.rand(6), tmp_path / "x.png")
