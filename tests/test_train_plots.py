"""Figures of a run: PNG files and input checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iresflow.train.plots import plot_learning_curves, plot_marginals, plot_traces

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
