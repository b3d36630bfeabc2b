"""The closed-form AR(p) Gaussian beside the flow in every evaluation."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.cli import main
from iresflow.data.datasets import load_dataset
from iresflow.data.store import write_store
from iresflow.models.config import ModelConfig
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.models.worst_cases import summarize_sequence_nll
from iresflow.runs import reference as reference_module
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.runs.reference import ReferenceWarning, compare_with_reference, fit_reference
from iresflow.runs.report import describe_evaluation
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.loop import train

TINY = TrainConfig(model=ModelConfig(n_blocks=1, hidden=8, layers=("mlp",), ar_order=0),
                   batch_size=8, epochs=1, device="cpu", eval_method="exact")
pytestmark = pytest.mark.filterwarnings("ignore:.*split has only:UserWarning")
KEYS = {"model", "order", "max_order", "parameters", "nll", "val_nll", "per_sequence",
        "flow_condition"}


def _ar_file(path: Path, count: int, length: int, features: int, seed: int) -> Path:
    """Strongly autoregressive sequences (x_t = 0.97 x_{t-1} + 0.05 noise) of varying lengths,
    with a gap inside some of them."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.zeros(count, length, features, dtype=torch.float64)
    x[:, 0] = torch.randn(count, features, generator=generator, dtype=torch.float64)
    for t in range(1, length):
        noise = torch.randn(count, features, generator=generator, dtype=torch.float64)
        x[:, t] = 0.97 * x[:, t - 1] + 0.05 * noise
    lengths = torch.randint(length // 2, length + 1, (count,), generator=generator)
    mask = torch.ones(count, length, dtype=torch.bool)
    mask[::3, 2] = False  # a missing frame in every third sequence
    np.savez(path, x=x.numpy(), lengths=lengths.numpy(), mask=mask.numpy())
    return path


def _by_hand(config: TrainConfig, split: str) -> tuple[float, int, torch.Tensor]:
    """The reference computed independently: orders 0..3 fitted on the training split, the
    best on the validation split, its NLL of ``split`` in nats/frame and per sequence."""
    data = load_data(config)
    train_split, val_split, scored = data.train, data.val, getattr(data, split)
    val_nll = []
    runs = [len(run) for row in train_split.mask.tolist()
            for run in "".join("1" if real else " " for real in row).split()]
    for order in range(min(3, max(runs) - 1) + 1):  # orders some run of real frames can fit
        model = AutoregressiveGaussian(data.features, data.max_len)
        model.fit(train_split.x, train_split.mask, order)
        val_nll.append(-float(model.log_prob(val_split.x, val_split.mask).sum()))
    best = int(np.argmin(val_nll))
    model = AutoregressiveGaussian(data.features, data.max_len)
    model.fit(train_split.x, train_split.mask, best)
    log_prob = model.log_prob(scored.x, scored.mask) + scored.log_jacobian.double()
    frames = scored.mask.sum(1).double()
    return -float(log_prob.sum() / frames.sum()), best, -log_prob / frames


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A barely trained flow without an AR layer on user files (with gaps) with strong AR
    structure, with a separate test file."""
    folder = tmp_path_factory.mktemp("reference")
    data = _ar_file(folder / "train.npz", 60, 12, 2, seed=0)
    test = _ar_file(folder / "test.npz", 15, 12, 2, seed=1)
    config = TINY.replace(data=str(data), test_data=str(test))
    train(config, folder / "run", progress=False)
    return folder / "run"


def test_evaluation_stores_flow_and_reference_and_warns_when_the_flow_is_worse(
    ar_run: Path, tmp_path: Path
) -> None:
    run = load_run(ar_run)
    scores = tmp_path / "scores.npz"
    with pytest.warns(ReferenceWarning, match="is worse than the closed-form AR"):
        result = evaluate_run(run, method="exact", scores=scores)
    stored = json.loads(run.paths.evaluation.read_text())["test"]["exact"]
    assert set(stored["reference"]) == KEYS
    assert set(stored["per_sequence"]) == set(stored["reference"]["per_sequence"]) == {
        "sequences", "median", "iqr", "worst", "worst_index", "threshold", "far_above",
        "far_above_indices"}
    assert stored["reference"]["flow_condition"] == "none"
    reference = stored["reference"]
    nll, order, per_sequence = _by_hand(run.config, "test")
    assert reference["nll"] == pytest.approx(nll, rel=0, abs=1e-9)
    assert reference["order"] == order >= 1  # the data are AR(1)
    assert reference["model"] == f"AR({order}) Gaussian"
    assert reference["per_sequence"] == summarize_sequence_nll(per_sequence).to_dict()
    assert stored["nll"] > reference["nll"] and stored["warnings"] == result["warnings"]
    # the flow's summary is that of the per-sequence scores written with --scores
    with np.load(scores) as columns:
        flow_nll = torch.from_numpy(columns["nll"])
    assert stored["per_sequence"] == summarize_sequence_nll(flow_nll).to_dict()


def test_the_printed_lines_name_both_models_and_the_warning(
    ar_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["evaluate", str(ar_run), "--split", "val"]) == 0
    lines = capsys.readouterr().out.splitlines()
    stored = json.loads((ar_run / "evaluation.json").read_text())["val"]["exact"]
    model = stored["reference"]["model"]
    flow = next(line for line in lines if line.strip().startswith("flow "))
    ref = next(line for line in lines if line.strip().startswith(f"{model} reference"))
    assert f"{stored['nll']:.4f}" in flow and f"{stored['reference']['nll']:.4f}" in ref
    assert f"{stored['per_sequence']['median']:.4f}" in flow
    assert any(line.startswith(f"reference: closed-form {model}") for line in lines)
    assert any(line.startswith("warning: the flow's val NLL") for line in lines)
    nll, _, _ = _by_hand(load_run(ar_run).config, "val")
    assert stored["reference"]["nll"] == pytest.approx(nll, rel=0, abs=1e-9)
    assert main(["evaluate", str(ar_run), "--no-reference", "--method", "roulette"]) == 0
    out = capsys.readouterr().out
    assert "flow " in out and "Gaussian" not in out and "warning" not in out
    stored = json.loads((ar_run / "evaluation.json").read_text())["test"]["roulette"]
    assert "reference" not in stored and "per_sequence" in stored


def test_no_warning_when_the_flow_is_better(tmp_path: Path) -> None:
    """Two training sequences of two frames in 8 dimensions: the closed-form fit is degenerate
    (a residual covariance of rank < 8 plus a small ridge), the flow is not."""
    x = torch.randn(30, 2, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    np.savez(tmp_path / "iid.npz", x=x.numpy())
    config = TINY.replace(data=str(tmp_path / "iid.npz"), max_train=2)
    train(config, tmp_path / "run", progress=False)
    run = load_run(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceWarning)
        result = evaluate_run(run, method="exact", save=False)
    assert result["nll"] < result["reference"]["nll"] and "warnings" not in result
    assert result["reference"]["nll"] == pytest.approx(_by_hand(config, "test")[0], abs=1e-9)


def test_far_above_warning_only_where_the_reference_has_none() -> None:
    result = {
        "split": "test", "nll": 1.0, "unit": "nats/frame",
        "per_sequence": {"far_above": 2, "worst": 90.0, "threshold": 12.0},
        "reference": {"model": "AR(1) Gaussian", "nll": 2.0, "per_sequence": {"far_above": 0}},
    }
    found = compare_with_reference(result)
    assert len(found) == 1 and found[0].startswith("2 test sequences of the flow are far above")
    result["reference"]["per_sequence"]["far_above"] = 1
    assert compare_with_reference(result) == []
    result["nll"] = 2.5
    assert len(compare_with_reference(result)) == 1
    assert compare_with_reference({**result, "reference": {"skipped": "why"}}) == []


def test_conditional_runs_label_the_reference_unconditional() -> None:
    summary = summarize_sequence_nll(torch.tensor([1.0, 2.0, 3.0])).to_dict()
    result = {
        "split": "test", "method": "exact", "nll": 2.0, "unit": "nats/frame", "sequences": 3,
        "checkpoint": "best", "epoch": 1, "per_sequence": summary,
        "reference": {"model": "AR(2) Gaussian", "order": 2, "max_order": 3, "parameters": 9,
                      "nll": 2.5, "val_nll": 2.4, "per_sequence": summary,
                      "flow_condition": "label"},
    }
    text = describe_evaluation(result)
    assert "unconditional, p(x), while the flow is conditional on its label" in text
    assert "warning" not in text
    skipped = describe_evaluation({**result, "reference": {"skipped": "too large"}})
    assert "reference: not computed (too large)" in skipped


def test_a_store_gives_the_in_memory_reference_or_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 10, (40,), generator=generator)
    x = torch.randn(40, 9, 2, generator=generator, dtype=torch.float64).cumsum(1)
    x = torch.where((torch.arange(9) < lengths.unsqueeze(1)).unsqueeze(-1), x, 0.0)
    np.savez(tmp_path / "data.npz", x=x.numpy(), lengths=lengths.numpy())
    write_store(tmp_path / "store", lengths, [x[b, : lengths[b]] for b in range(40)],
                dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        stored = load_dataset(str(tmp_path / "store"))
        in_memory = load_dataset(str(tmp_path / "data.npz"))
    from_store = fit_reference(stored, "test")
    expected = fit_reference(in_memory, "test")
    assert from_store["order"] == expected["order"] >= 1
    assert from_store["nll"] == pytest.approx(expected["nll"], rel=1e-5)
    monkeypatch.setattr(reference_module, "REFERENCE_MAX_VALUES", 100)
    assert "more than the 1e+02" in fit_reference(stored, "test")["skipped"]
