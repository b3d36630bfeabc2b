"""The long-range benchmark: its references and one tiny trained row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks.figures import long_range_curves
from benchmarks.long_range import DEFAULT_RECIPES, GRU_MAF, KEY, models, references, run_seed, table
from benchmarks.records import merge_records, write_blocks
from iresflow.nn.attention import ContractiveL2MultiheadAttention


def test_floor_lies_far_below_the_ar_gaussian() -> None:
    for name in ("repeated_motif", "nonlinear_seasonal"):
        result = references({"data": name, "max_train": 200, "max_eval": 100})
        assert result["floor"] < result["ar"] - 2.0, result  # nats/frame


@pytest.mark.slow
def test_one_tiny_seed_prints_a_row_per_model(tmp_path: Path) -> None:
    settings = {"epochs": 1, "max_train": 8, "max_eval": 4, "n_blocks": 1, "hidden": 8,
                "batch_size": 4}
    result = run_seed("repeated_motif", 0, list(DEFAULT_RECIPES), settings, tmp_path,
                      diagnose=True, figures=tmp_path / "figures")
    assert (tmp_path / "figures" / "long_range_attention_repeated_motif.png").stat().st_size > 0
    attention = result[DEFAULT_RECIPES[1]]
    assert 0 < attention["attention_usage"] <= 1
    assert 0 < attention["attention_use_full_length"] <= 1
    (diagnosis,) = attention["diagnosis"]  # one block, one attention branch
    for key in ("random_16", "random_n", "data_mean", "data_max", "adversarial", "value_path"):
        assert 0 < diagnosis[key] <= 1 + 1e-9, (key, diagnosis)
    assert diagnosis["data_mean"] <= diagnosis["data_max"]
    assert 0 < diagnosis["length_share"] < 1 and 1 <= diagnosis["effective_tokens"] <= 64
    assert 0 < diagnosis["copy_mass_uniform"] < 1
    assert result[DEFAULT_RECIPES[0]]["attention_usage"] is None
    gru = result[GRU_MAF]
    assert math.isfinite(gru["test_nll"]) and gru["history"] and gru["attention_usage"] is None
    text = table("repeated_motif", [result])
    assert text.count("\n| ") == 6  # header rule, floor, AR, two recipes and the GRU + MAF
    page = tmp_path / "page.md"
    page.write_text("# p\n<!-- long-range:start -->\nold\n<!-- long-range:end -->\nend\n")
    write_blocks(page, {"long-range": text})
    assert text in page.read_text() and "old" not in page.read_text()
    curves = tmp_path / "figures" / "long_range_curves_repeated_motif.png"
    assert long_range_curves("repeated_motif", [result], models(result), curves) == curves
    assert curves.stat().st_size > 0


def test_constant_sequence_jacobian_is_the_value_path() -> None:
    # The diagnosis reads the value path off the Jacobian at a constant sequence: there the
    # attention is uniform and the logits are flat, so J = (1/N) 1 1^T kron M^T, with
    # M = [A_1 W^{V,1}, ..., A_H W^{V,H}] W^O and A_h = W^{Q,h} W^{Q,h T} / sqrt(d_h).
    branch = ContractiveL2MultiheadAttention(dim=4, heads=2, coeff=0.9).double()
    a, n, d_h = branch.attention, 5, 2
    value = torch.cat([a.w_query[:, h * d_h:(h + 1) * d_h] @ a.w_query[:, h * d_h:(h + 1) * d_h].T
                       @ a.w_value[:, h * d_h:(h + 1) * d_h] / math.sqrt(d_h)
                       for h in range(2)], 1) @ a.w_out
    x = torch.full((n, 4), 0.7, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda t: branch(t.unsqueeze(0))[0], x)
    expected = torch.kron(torch.full((n, n), 1.0 / n, dtype=torch.float64), value.T.contiguous())
    expected = expected * 0.9 / branch.raw_bound(n)
    torch.testing.assert_close(jac.reshape(n * 4, n * 4), expected)


def test_results_of_the_same_seed_are_merged_by_model() -> None:
    earlier = [{"dataset": "d", "seed": 0, "floor": 0.0, "a": {"v": 1}, "b": {"v": 2}}]
    later = [{"dataset": "d", "seed": 0, "b": {"v": 3}, "c": {"v": 4}},
             {"dataset": "d", "seed": 1, "a": {"v": 5}}]
    runs = merge_records([later, earlier], KEY)  # the first file given wins
    assert {model: runs[0][model]["v"] for model in models(runs[0])} == {"a": 1, "b": 3, "c": 4}
    assert [r["seed"] for r in runs] == [0, 1]


def test_a_model_that_only_some_seeds_ran_says_on_how_many() -> None:
    def row(test_nll: float, best_epoch: int) -> dict:
        return {"test_nll": test_nll, "gap_closed": 0.5, "train_seconds": 10.0,
                "best_epoch": best_epoch, "attention_usage": None}

    runs = [{"dataset": "d", "seed": 0, "floor": 0.0, "ar": 1.0, "ar_order": 3,
             "a": row(0.5, 4), "b": row(0.7, 2)},
            {"dataset": "d", "seed": 1, "floor": 0.0, "ar": 1.0, "ar_order": 3,
             "a": row(0.3, 6)}]
    lines = table("d", runs).splitlines()
    assert lines[0] == "### d (test NLL, nats/frame; 2 seed(s))"
    assert lines[-2].startswith("| a | 0.400 ± 0.141 | 0.50 ± 0.00 | 10 ± 0 | 4,6 |")
    assert lines[-1].startswith("| b (1 seed(s)) | 0.700 | 0.50 | 10 | 2 |")
