"""Paper reproductions in ``examples/`` (docs/math.md#experiments (E1-E3), checks H7,
H8 (docs/math.md#checks)), run in ``--quick`` mode."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from oracles import jacobian

from iresflow.nn.bounds import phi_inv

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_quick(name: str, out: Path) -> dict:
    """Run an example's ``--quick`` mode into ``out``; return the JSON it wrote."""
    returned = load_example(name).main(["--quick", "--out", str(out)])
    written = json.loads((out / f"{name}.json").read_text())
    assert written["experiment"] == name and written["quick"] is True
    assert json.dumps(returned, sort_keys=True) == json.dumps(written, sort_keys=True)
    assert (out / f"{name}.png").stat().st_size > 10_000
    return written


@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_closed_form_row_norm_matches_autograd_jacobian(scale):
    bound_tightness = load_example("bound_tightness")
    attn = bound_tightness.unit_attention()
    x = scale * torch.randn(3, 7, dtype=torch.float64)
    jac = jacobian(lambda t, m: attn(t), x.unsqueeze(-1))  # (K, N, N) with D = 1
    expected = jac[:, 0, :].abs().sum(dim=1)
    torch.testing.assert_close(bound_tightness.row_jacobian_norm(x), expected, rtol=1e-12,
                               atol=1e-12)


def test_bound_tightness_quick(tmp_path):
    result = run_quick("bound_tightness", tmp_path)
    rows = result["results"]
    assert [r["n"] for r in rows] == result["config"]["lengths"]
    for r in rows:
        # H7: unit weights, d_h = 1, so the bound is exactly 4 phi^{-1}(N - 1) + 1.
        assert math.isclose(r["upper_bound"], 4 * phi_inv(float(r["n"] - 1)) + 1, rel_tol=1e-9)
        assert 0.7 < r["ratio"] < 1  # a lower bound, and the search found a near-tight one
        assert abs(r["closed_form_minus_autograd"]) < 1e-10
        assert r["top_lower_bounds"][0] >= r["top_lower_bounds"][-1]
        if "dense_jacobian_norm" in r:
            assert r["dense_jacobian_norm"] >= r["lower_bound"] - 1e-12  # max row >= row 0
            assert r["library_search"] <= r["upper_bound"]
    lowers = [r["lower_bound"] for r in rows]
    assert lowers == sorted(lowers)
    assert result["slope_upper"] > 0 and result["slope_lower"] > 0
    assert 0.8 < result["slope_ratio"] < 1.2  # similar slopes in log N (Kim Fig. 2)


def test_numerical_invertibility_quick(tmp_path):
    result = run_quick("numerical_invertibility", tmp_path)
    iterations = result["config"]["iterations"]
    models = {(r["model"], r["coeff"]): r for r in result["results"]}
    assert len(models) == 2 * len(result["config"]["coeffs"])
    for coeff in result["config"]["coeffs"]:
        dp, l2 = models[("dot-product", coeff)], models[("L2", coeff)]
        for r in (dp, l2):
            assert len(r["errors"]) == iterations + 1
            assert all(math.isfinite(e) for e in r["errors"])
        # H8: dot-product attention cannot be inverted (O(1) error), L2 converges.
        assert dp["final_error"] > 0.5
        assert l2["final_error"] < 1e-5
        assert l2["fraction_below_1e-3"] == 1.0 and dp["fraction_below_1e-3"] < 1.0
        for solver in ("plain", "anderson"):
            # the returned iterate has a residual below the default float32 tolerance,
            # 1e-6 ||y||_inf ~ 1e-5 for entries up to 10; L2 attention barely moves it
            assert l2[solver]["converged_fraction"] == 1.0 and l2[solver]["max_error"] < 2e-5
            assert l2[solver]["converged_elsewhere"] == 0 and not l2[solver]["warned"]
        assert dp["plain"]["converged_fraction"] < 1.0 and dp["plain"]["warned"]


def test_same_cluster_mean_averages_tokens_with_equal_labels():
    depth_stability = load_example("depth_stability")
    x = torch.tensor([[[1.0], [10.0], [3.0], [20.0]]])
    labels = torch.tensor([[0, 1, 0, 2]])
    expected = torch.tensor([[[2.0], [10.0], [2.0], [20.0]]])
    torch.testing.assert_close(depth_stability.same_cluster_mean(x, labels), expected)


def test_depth_stability_quick(tmp_path):
    result = run_quick("depth_stability", tmp_path)
    config = result["config"]
    runs = result["runs"]
    assert len(runs) == len(config["lrs"]) * 4
    reference = result["references"][0]
    assert abs(reference["identity"] - config["noise"] ** 2) < 0.02
    assert reference["same_cluster_mean"] < reference["identity"]
    for r in runs:
        assert len(r["loss"]) == config["steps"] or r["diverged_at_step"] is not None
        assert all(len(row["layer_grad_norms"]) == config["layers"] for row in r["logged"])
        if not r["exploded"]:
            assert r["final_loss"] < r["loss"][0]
            assert math.isfinite(r["eval_loss"])
