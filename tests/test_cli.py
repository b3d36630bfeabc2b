"""The ``iresflow`` command, called in-process through ``main`` (and once as a subprocess)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.cli import main
from iresflow.models.distributions import NU_INIT, StudentTSequence
from iresflow.nn.recurrent import CausalGRU
from iresflow.runs.load import load_run
from iresflow.runs.report import describe_training
from iresflow.runs.sample import Samples, sample_run
from iresflow.train.checkpoint import CheckpointError, load_checkpoint
from iresflow.train.config import TrainConfig
from iresflow.train.factories import build_model, load_data
from iresflow.train.loop import TrainResult
from iresflow.train.paths import RunPaths
from iresflow.transforms.autoregressive import AutoregressiveAffine

TINY = [
    "--n-blocks", "1", "--hidden", "8", "--max-train", "12", "--max-eval", "6",
    "--batch-size", "6", "--scheduler", "plateau", "--eval-method", "exact", "--quiet",
    "--layers", "attention,mlp", "--ar-order", "0",
]


class _Payload:
    """Pickles as a call of ``os.mkdir(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, device: torch.device) -> Path:
    """A tiny trained run (on the test device); its settings come from a file and flags."""
    folder = tmp_path_factory.mktemp("cli")
    config = folder / "run.toml"
    config.write_text('epochs = 5\nlr = 0.01\nattention = "lipschitznorm"\n', encoding="utf-8")
    out = folder / "run"
    flags = ["--epochs", "1", "--out", str(out), "--device", str(device)]
    assert main(["train", "--config", str(config)] + flags + TINY) == 0
    return out


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("iresflow: error: "), err
    return lines[0]


def test_module_help_runs_as_a_subprocess() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "iresflow", "--help"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )
    assert completed.returncode == 0
    for command in ("train", "evaluate", "sample", "forecast", "info"):
        assert command in completed.stdout


def test_train_writes_the_run_folder_with_flags_over_file(run: Path) -> None:
    config = TrainConfig.from_toml(run / "config.toml")
    settings = (config.epochs, config.lr, config.model.attention, config.model.hidden)
    assert settings == (1, 0.01, "lipschitznorm", 8)
    for name in ("checkpoints/last.pt", "checkpoints/best.pt", "metrics.jsonl", "metrics.csv",
                 "evaluation.json", "plots/learning_curves.png", "plots/samples.png",
                 "plots/marginals.png"):
        assert (run / name).is_file(), name
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["test"]["exact"]["unit"] == "nats/frame"
    assert evaluation["test"]["exact"]["sequences"] == 6


def test_evaluate_exact_reproduces_and_roulette_reports_stderr(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained = json.loads((run / "evaluation.json").read_text())["test"]["exact"]["nll"]
    assert main(["evaluate", str(run), "--device", "cpu"]) == 0
    assert json.loads((run / "evaluation.json").read_text())["test"]["exact"]["nll"] == trained
    assert main(["evaluate", str(run), "--method", "roulette", "--n-samples", "3",
                 "--split", "val"]) == 0
    out = capsys.readouterr().out
    assert "val NLL" in out and "standard error" in out
    result = json.loads((run / "evaluation.json").read_text())["val"]["roulette"]
    assert result["n_samples"] == 3 and result["stderr"] > 0
    assert "exact" in json.loads((run / "evaluation.json").read_text())["test"]


def test_evaluate_scores_every_sequence_as_csv_or_npz(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table, arrays = tmp_path / "out.csv", tmp_path / "out.npz"
    assert main(["evaluate", str(run), "--scores", str(table)]) == 0
    assert main(["evaluate", str(run), "--scores", str(arrays)]) == 0
    with table.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["index", "length", "log_prob", "nll", "label"]
    assert len(rows) == 6 and {row["label"] for row in rows} <= {str(k) for k in range(1, 10)}
    evaluation = json.loads((run / "evaluation.json").read_text())["test"]["exact"]
    frames = np.array([int(row["length"]) for row in rows])
    log_prob = np.array([float(row["log_prob"]) for row in rows])
    assert -log_prob.sum() / frames.sum() == pytest.approx(evaluation["nll"])
    nll = np.array([float(row["nll"]) for row in rows])
    np.testing.assert_allclose(nll, -log_prob / frames)
    with np.load(arrays) as data:
        np.testing.assert_allclose(data["log_prob"], log_prob)
    capsys.readouterr()
    assert main(["evaluate", str(run), "--scores", str(tmp_path / "out.txt")]) == 1
    assert "scores must name a .csv or .npz file" in _error_line(capsys)
    assert main(["evaluate", str(run), "--classify"]) == 1
    assert "classify needs a run trained with condition = label (--condition label)" in (
        _error_line(capsys)
    )
    assert main(["sample", str(run), "--label", "3"]) == 1
    assert "label (--label) needs a conditional run" in _error_line(capsys)


def test_sample_saves_raw_sequences_and_a_plot(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s" / "samples.npz"
    assert main(["sample", str(run), "--num", "3", "--length", "5", "--out", str(out)]) == 0
    with np.load(out) as data:
        assert data["x"].shape == (3, 5, 12) and data["mask"].all()
        assert data["lengths"].tolist() == [5, 5, 5]
        assert np.isfinite(data["x"]).all()
    assert out.with_suffix(".png").is_file()
    assert "converged" in capsys.readouterr().out
    assert main(["sample", str(run), "--num", "4", "--seed", "1", "--out", str(out)]) == 0
    with np.load(out) as data:
        lengths = data["lengths"]
        assert (data["mask"].sum(axis=1) == lengths).all()
        assert ((lengths >= 1) & (lengths <= 29)).all()
        assert (data["x"][~data["mask"]] == 0).all()


def test_sample_temperature_scales_the_noise_of_the_draws(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cold.npz"
    argv = ["sample", str(run), "--num", "3", "--length", "5", "--seed", "2"]
    assert main([*argv, "--temperature", "0.5", "--out", str(out)]) == 0
    loaded = load_run(run)
    with np.load(out) as data:
        cold = torch.from_numpy(data["x"])
    assert torch.equal(cold, sample_run(loaded, num=3, length=5, seed=2, temperature=0.5).x)
    hot = sample_run(loaded, num=3, length=5, seed=2)
    mask, preprocessing = torch.ones(3, 5, dtype=torch.bool), loaded.dataset.preprocessing
    assert preprocessing is not None
    with torch.no_grad():  # back in model units, the noise of the draws halves
        noise = [loaded.model.transform_to_noise(preprocessing.forward(x, mask)[0], mask)
                 for x in (cold, hot.x)]
    torch.testing.assert_close(noise[0], 0.5 * noise[1], atol=1e-4, rtol=1e-4)


def test_info_reports_size_and_lipschitz_constants(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(run), "--seq-len", "6"]) == 0
    out = capsys.readouterr().out
    config = TrainConfig.from_dict(load_checkpoint(run / "checkpoints" / "best.pt")["config"])
    model = build_model(config, load_data(config))
    assert f"parameters: {sum(p.numel() for p in model.parameters()):,}" in out
    assert "block0.attention" in out and "block0.mlp" in out
    assert 'attention = "lipschitznorm"' in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--data", "no_such_data", "--out", "{tmp}/r"], "unknown dataset"),
        (["train", "--heads", "5", "--out", "{tmp}/r"], "heads must divide"),
        (["train", "--resume"], "--resume needs --out"),
        (["train", "--config", "{tmp}/missing.toml"], "cannot read config file"),
        (["evaluate", "{tmp}/missing"], "run folder not found"),
        (["info", "{tmp}"], "holds no checkpoint"),
        (["sample", "{tmp}", "--num", "0"], "num must be >= 1, got 0"),
        (["sample", "{tmp}", "--temperature", "0"], "temperature must be > 0, got 0"),
        (["sample", "{tmp}", "--temperature", "inf"], "temperature must be finite, got inf"),
    ],
)
def test_errors_are_one_line_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([a.format(tmp=tmp_path) for a in argv]) == 1
    assert message in _error_line(capsys)


@pytest.mark.parametrize(
    ("text", "message"),
    [("colour = 1\n", "unknown option 'colour'"), ("epochs = = 2\n", "invalid TOML")],
)
def test_bad_config_files_are_one_line_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    (tmp_path / "bad.toml").write_text(text, encoding="utf-8")
    config, out = str(tmp_path / "bad.toml"), str(tmp_path / "r")
    assert main(["train", "--config", config, "--out", out]) == 1
    assert message in _error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--colour", "red"], "unrecognized arguments: --colour"),
        (["train", "--attention", "dot"], "invalid choice: 'dot'"),
        (["train", "--epochs", "many"], "invalid int value: 'many'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["sample", "run", "--num", "many"], "argument --num: invalid int value: 'many'"),
    ],
)
def test_malformed_command_lines_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    assert message in _error_line(capsys)


def test_run_folder_errors(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(run)] + TINY) == 1
    assert "not empty" in _error_line(capsys)
    assert main(["train", "--out", str(run), "--resume"] + TINY + ["--hidden", "16"]) == 1
    assert "cannot resume" in _error_line(capsys)
    # A finished run resumes with the settings of its folder (the default hidden=64 would clash).
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "trained 1 epochs" in out
    assert "it may have been cut short" in out  # its only epoch is its best: the cap ended it

    assert main(["info", str(run), "--device", "tpu"]) == 1
    assert "device must be" in _error_line(capsys)

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for name in ("best.pt", "last.pt"):
        (copy / "checkpoints" / name).write_bytes(b"\x00garbage")
    assert main(["evaluate", str(copy)]) == 1
    assert "cannot read checkpoint" in _error_line(capsys)

    marker = tmp_path / "marker"
    torch.save({"model": _Payload(marker)}, copy / "checkpoints" / "best.pt")
    assert main(["info", str(copy)]) == 1
    assert "refusing checkpoint" in _error_line(capsys)
    assert not marker.exists()


def test_edited_checkpoints_are_renormalised_or_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "edited"
    shutil.copytree(run, copy)
    best = copy / "checkpoints" / "best.pt"
    state = load_checkpoint(best)
    mlp = "transform.steps.3.branch.net.0.weight"
    for name in (mlp, "transform.steps.1.branch.branch.attention.w_value"):
        state["model"][name] = state["model"][name] * 100.0  # far beyond the constraint
    torch.save(state, best)
    loaded = load_run(copy, device="cpu")
    layer = loaded.model.get_submodule(mlp.rsplit(".", 1)[0])
    assert torch.linalg.matrix_norm(layer.weight, 2) > 10  # the raw weight is edited
    assert torch.linalg.matrix_norm(layer.weight_normalized(), 2) <= layer.coeff * (1 + 1e-5)
    for row in loaded.model.lipschitz_report(6):
        assert row["estimate"] <= row["certified"] * (1 + 1e-5) and row["certified"] < 1
    assert main(["info", str(copy), "--seq-len", "6"]) == 0
    assert "guarantees: re-checked at load" in capsys.readouterr().out

    state["model"][mlp][0, 0] = torch.nan
    torch.save(state, best)
    assert main(["info", str(copy)]) == 1
    assert f"refusing {best}: {mlp} holds NaN or Inf values" in _error_line(capsys)
    with pytest.raises(CheckpointError, match="holds NaN"):
        load_run(copy)


def test_relative_window_trains_and_round_trips_through_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--epochs", "1", "--device", "cpu", "--relative-window",
            "2"]
    assert main(argv + TINY) == 0
    state = load_checkpoint(out / "checkpoints" / "best.pt")
    assert TrainConfig.from_dict(state["config"]).model.relative_window == 2
    tables = {k: v for k, v in state["model"].items() if k.endswith("attention.relative_bias")}
    assert tables and all(v.shape == (4, 5) for v in tables.values())  # 4 heads, offsets -2..2
    assert all(bool(v.abs().sum() > 0) for v in tables.values())  # trained away from zero
    loaded = load_run(out, device="cpu")
    assert loaded.config.model.relative_window == 2
    for name, value in tables.items():
        assert torch.equal(loaded.model.state_dict()[name], value)
    assert main(["info", str(out), "--seq-len", "6"]) == 0
    assert "relative_window = 2" in capsys.readouterr().out


def _write_uea(path: Path, cases: list[np.ndarray]) -> None:
    """A UEA/sktime ``.ts`` file: header, ``@data``, one case per line, dimensions split by ':'."""
    lines = ["@problemName toy", f"@dimensions {cases[0].shape[1]}", "@classLabel true a b",
             "@data"]
    for i, case in enumerate(cases):
        dims = [",".join(repr(float(v)) for v in case[:, d]) for d in range(case.shape[1])]
        lines.append(":".join(dims) + (":a" if i % 2 else ":b"))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.filterwarnings("ignore:.*fewer than 30")
def test_train_on_a_uea_train_test_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generator = np.random.default_rng(0)
    train_cases = [generator.standard_normal((int(n), 2)) for n in generator.integers(4, 8, 36)]
    test_cases = [generator.standard_normal((int(n), 2)) for n in generator.integers(4, 10, 7)]
    _write_uea(tmp_path / "Toy_TRAIN.ts", train_cases)
    _write_uea(tmp_path / "Toy_TEST.ts", test_cases)
    out = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "Toy_TRAIN.ts"), "--test-data",
            str(tmp_path / "Toy_TEST.ts"), "--out", str(out), "--epochs", "1",
            "--max-train", "none", "--max-eval", "none"] + TINY[:4] + ["--quiet"]
    with pytest.warns(UserWarning, match="only 7 sequences"):
        assert main(argv) == 0
    config = TrainConfig.from_toml(out / "config.toml")
    assert config.test_data == str((tmp_path / "Toy_TEST.ts").resolve())
    evaluation = json.loads((out / "evaluation.json").read_text())["test"]["exact"]
    assert evaluation["sequences"] == 7
    run = load_run(out)
    assert (len(run.dataset.train) + len(run.dataset.val), len(run.dataset.test)) == (36, 7)
    assert run.dataset.max_len == max(len(c) for c in train_cases + test_cases)
    assert "test NLL" in capsys.readouterr().out
    # a test file needs a data file
    assert main(["train", "--test-data", str(tmp_path / "Toy_TEST.ts"), "--out",
                 str(tmp_path / "r2")]) == 1
    assert "test_data needs data and test_data to be .npz or .ts files" in _error_line(capsys)


def test_a_student_t_run_trains_evaluates_samples_and_reloads(tmp_path: Path) -> None:
    """``--base student-t`` (docs/math.md#student-t-base) end to end: the setting and the
    learned degrees of freedom are stored, and evaluate and sample use them."""
    out = tmp_path / "run"
    assert main(["train", "--base", "student-t", "--epochs", "1", "--out", str(out),
                 "--device", "cpu", *TINY]) == 0
    assert TrainConfig.from_toml(out / "config.toml").model.base == "student-t"
    run = load_run(out)
    assert run.model_config.base == "student-t"
    assert isinstance(run.model.base, StudentTSequence) and run.model.base.nu.shape == (12,)
    stored = load_checkpoint(out / "checkpoints" / "best.pt")["model"]["base.log_excess"]
    assert torch.equal(run.model.base.log_excess.detach(), stored)
    assert not torch.allclose(run.model.base.nu, torch.tensor(NU_INIT))  # it was trained
    trained = json.loads((out / "evaluation.json").read_text())["test"]["exact"]["nll"]
    assert main(["evaluate", str(out), "--device", "cpu"]) == 0
    assert json.loads((out / "evaluation.json").read_text())["test"]["exact"]["nll"] == trained
    samples = tmp_path / "samples.npz"
    assert main(["sample", str(out), "--num", "3", "--seed", "1", "--out", str(samples)]) == 0
    with np.load(samples) as data:
        assert np.isfinite(data["x"]).all() and (data["x"][~data["mask"]] == 0).all()


def test_a_gru_conditioned_run_trains_evaluates_samples_and_reloads(tmp_path: Path) -> None:
    """``--layers autoregressive,mlp --conditioner gru`` end to end: the setting is stored, the
    reloaded steps have GRU conditioners, evaluation reproduces and sampling inverts them."""
    out = tmp_path / "run"
    flags = [*TINY[:-4], "--layers", "autoregressive,mlp", "--ar-order", "0"]
    assert main(["train", "--conditioner", "gru", "--epochs", "1", "--out", str(out),
                 "--device", "cpu", *flags]) == 0
    assert TrainConfig.from_toml(out / "config.toml").model.conditioner == "gru"
    run = load_run(out)
    nets = [step.conditioner for step in run.model.transform.steps
            if isinstance(step, AutoregressiveAffine)]
    assert nets and all(isinstance(net, CausalGRU) for net in nets)
    trained = json.loads((out / "evaluation.json").read_text())["test"]["exact"]["nll"]
    assert main(["evaluate", str(out), "--device", "cpu"]) == 0
    assert json.loads((out / "evaluation.json").read_text())["test"]["exact"]["nll"] == trained
    samples = tmp_path / "samples.npz"
    assert main(["sample", str(out), "--num", "3", "--seed", "1", "--out", str(samples)]) == 0
    with np.load(samples) as data:
        assert np.isfinite(data["x"]).all() and (data["x"][~data["mask"]] == 0).all()


def test_bare_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "usage: iresflow" in captured.err and "commands:" in captured.err
    assert "train" in captured.err and "Traceback" not in captured.err


def test_usage_errors_name_the_command_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate"]) == 2
    line = _error_line(capsys)
    assert line == ("iresflow: error: the following arguments are required: RUN "
                    "(see 'iresflow evaluate --help')")


def test_bad_out_is_refused_before_loading(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("loaded although --out is unusable")

    monkeypatch.setattr("iresflow.train.loop.load_data", never)
    monkeypatch.setattr("iresflow.cli.load_run", never)
    file = tmp_path / "file.txt"
    file.write_text("not a folder")
    assert main(["train", "--out", str(file)] + TINY) == 1
    assert f"run folder {file} is a file, not a folder" in _error_line(capsys)
    assert main(["train", "--out", str(file / "run")] + TINY) == 1
    assert f"{file} is a file" in _error_line(capsys)
    assert main(["train", "--out", str(run)] + TINY) == 1  # not empty: before loading too
    assert "continue it with resume (--resume) or start again with overwrite (--overwrite)" in (
        _error_line(capsys)
    )
    for out, message in [(file / "s.npz", f"{file} is a file"), (tmp_path / "s.csv", ".npz"),
                         (tmp_path, "must end in .npz")]:
        assert main(["sample", str(run), "--out", str(out)]) == 1
        assert message in _error_line(capsys)
    (tmp_path / "folder.npz").mkdir()
    assert main(["sample", str(run), "--out", str(tmp_path / "folder.npz")]) == 1
    assert "is a folder, not a file" in _error_line(capsys)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="permissions do not bind the superuser")
def test_unwritable_out_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["train", "--out", str(locked / "run")] + TINY) == 1
        assert "is not writable" in _error_line(capsys)
    finally:
        locked.chmod(0o700)


def test_sample_reports_residual_against_tolerance(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "samples.npz"
    assert main(["sample", str(run), "--num", "2", "--out", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("inverse:"))
    loaded = load_run(run)
    samples = sample_run(loaded, num=2)
    residual, tolerance = samples.diagnostics["residual"], samples.diagnostics["tolerance"]
    assert 0 <= residual < tolerance and samples.diagnostics["converged"]
    share = math.floor(residual / tolerance * 1000) / 1000
    assert f"worst residual {residual:.2e}, {share:.3f} of its tolerance {tolerance:.2e}: " \
           f"converged" in line and share < 1
    # the reported pair is the solve with the largest residual relative to its tolerance
    ratios = [
        (step.last_inverse_stats.residual / step.last_inverse_stats.tolerance).max()
        for step in loaded.model.modules() if getattr(step, "last_inverse_stats", None)
    ]
    assert residual / tolerance == pytest.approx(float(max(ratios)))

    def unconverged(*args: object, **kwargs: object) -> Samples:
        diagnostics = {**samples.diagnostics, "converged": False, "residual": 2e-5,
                       "tolerance": 1e-6}
        return dataclasses.replace(samples, diagnostics=diagnostics)

    monkeypatch.setattr("iresflow.cli.sample_run", unconverged)
    assert main(["sample", str(run), "--num", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "residual 2.00e-05, 20.000 of its tolerance 1.00e-06: NOT converged" in printed
    assert ": converged" not in printed


@pytest.mark.parametrize(
    ("epochs", "best", "stopped_early", "patience", "note"),
    [
        (60, 56, False, 10, True),   # the cap came before patience could have run out
        (60, 50, False, 10, False),  # ten epochs without a better one: stopping was possible
        (40, 38, True, 2, False),    # early stopping ended it
        (60, 55, False, 0, True),    # no patience: the last tenth
        (60, 54, False, 0, False),
    ],
)
def test_train_says_when_a_run_was_cut_short(epochs, best, stopped_early, patience, note):
    result = TrainResult(RunPaths(Path("run")), epochs, best, -1.0, stopped_early, [])
    text = describe_training(result, patience)
    assert text.startswith(f"trained {epochs} epochs")
    assert ("may have been cut short" in text) == note
