"""The quantised-features benchmark: its table of the archive data and the roots it reports."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks import cli
from benchmarks.quantised import largest_root
from iresflow.transforms.temporal import AutoregressiveLinear


def test_largest_root_is_one_for_a_unit_root_and_below_for_a_mean_reverting_process() -> None:
    layer = AutoregressiveLinear(1, order=2).double()
    with torch.no_grad():
        # x_t = 1.3 x_(t-1) - 0.3 x_(t-2): roots of (z - 1)(z - 0.3)
        layer.lag_weights[2, :2] = torch.tensor([1.3, -0.3], dtype=torch.float64).reshape(2, 1, 1)
    assert largest_root(layer) == pytest.approx(1.0, abs=1e-12)
    two = AutoregressiveLinear(2, order=1).double()
    with torch.no_grad():
        two.lag_weights[1, 0] = torch.tensor([[0.5, 0.0], [0.0, -0.8]], dtype=torch.float64)
    assert largest_root(two) == pytest.approx(0.8, abs=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("aeon") is None,
                    reason="the archive datasets ship with aeon")
def test_the_table_names_the_quantised_archive_features(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert cli.main(["quantised", "--datasets", "PickupGestureWiimoteZ", "GunPoint"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pickup = next(line.split() for line in lines if line.startswith("Pickup"))
    assert pickup[1:3] == ["0", "74"] and float(pickup[-1]) == pytest.approx(1 / 26, rel=1e-3)
    assert any(line.startswith("GunPoint") and "no repeating feature" in line for line in lines)
