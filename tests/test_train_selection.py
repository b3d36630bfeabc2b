"""Runs that choose among the configured model and alternatives on the validation split."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from iresflow.cli import main
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.epoch import TrainingDivergedError
from iresflow.train.factories import load_data
from iresflow.train.fit import fit
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from iresflow.train.selection import (
    ALTERNATIVES,
    CandidateResult,
    candidate_paths,
    candidates,
    choose,
    read_selection,
    resolved_alternatives,
    train_candidates,
)
from tests.tiny_runs import TINY, forget_setting

#: TINY with the default's alternative, two epochs.
SELECTING = TINY.replace(alternative="auto", epochs=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("selection") / "run"
    train(SELECTING, folder, progress=False)
    return folder


def test_the_default_tries_the_alternatives_unless_layers_are_chosen() -> None:
    assert TrainConfig().alternative == "auto"
    assert resolved_alternatives(TrainConfig(), 1) == ("recurrent",)
    assert resolved_alternatives(TrainConfig(), 2) == ("recurrent", "maf")  # several features
    chosen = TrainConfig.from_dict({"layers": ["attention", "mlp"]})
    assert resolved_alternatives(chosen, 6) == ()
    assert [name for name, _ in candidates(chosen, 6)] == ["configured"]
    assert [name for name, _ in candidates(TrainConfig(alternative="none"), 6)] == ["configured"]
    for name in ALTERNATIVES:  # one named alternative, whatever the layers and the frame size
        forced = chosen.replace(alternative=name)
        assert resolved_alternatives(forced, 1) == (name,)
        (_, configured), (got, alternative) = candidates(forced, 1)
        assert configured == forced.replace(alternative="none")
        assert got == name and alternative.alternative == "none"
        changes = ALTERNATIVES[name]
        flat = alternative.to_dict()
        assert all(flat[key] == value for key, value in changes.items())
        # every other setting is the configured one's
        differ = {key for key, value in flat.items() if configured.to_dict()[key] != value}
        assert differ == set(changes)
    maf = dict(candidates(TrainConfig(), 6))["maf"]
    assert (maf.model.layers, maf.model.conditioner, maf.model.ar_order, maf.optimizer) == (
        ("maf", "maf"), "gru", 0, "adamw")
    with pytest.raises(ConfigError, match="alternative"):
        TrainConfig(alternative="gru")


def test_choose_keeps_the_lowest_finite_validation_nll_and_the_first_on_a_tie() -> None:
    a, b = CandidateResult("configured", 1.0, 3, 5), CandidateResult("recurrent", 1.0, 2, 5)
    assert choose([a, b]) is a
    better = CandidateResult("recurrent", 0.5, 2, 5)
    assert choose([a, better]) is better
    failed = CandidateResult("recurrent", math.nan, 0, 0, "diverged")
    assert choose([a, failed]) is a
    with pytest.raises(TrainingDivergedError, match="configured: no finite .*recurrent: diverged"):
        choose([CandidateResult("configured", math.inf, 0, 1), failed])


def test_a_candidate_that_diverges_is_recorded_and_the_other_kept() -> None:
    choices = candidates(TrainConfig(), 1)

    def train_one(name: str, config: TrainConfig) -> float:
        if name == "recurrent":
            raise TrainingDivergedError("non-finite loss at step 3")
        return 2.5

    kept, value, results = train_candidates(choices, train_one, lambda v: (v, 4, 6))
    assert (kept, value) == ("configured", 2.5)
    assert results == (CandidateResult("configured", 2.5, 4, 6),
                       CandidateResult("recurrent", math.nan, 0, 0, "non-finite loss at step 3"))

    def diverge(name: str, config: TrainConfig) -> float:
        raise TrainingDivergedError(f"{name} diverged")

    with pytest.raises(TrainingDivergedError, match="configured: configured diverged; recurrent"):
        train_candidates(choices, diverge, lambda v: (v, 0, 0))


def test_the_run_folder_holds_the_kept_candidate_and_every_run(run: Path) -> None:
    results = read_selection(RunPaths(run))  # japanese_vowels: 12 features, three candidates
    assert results is not None and [r.name for r in results] == ["configured", "recurrent",
                                                                 "maf"]
    kept = choose(results)
    assert json.loads((run / "selection.json").read_text())["kept"] == kept.name
    assert kept.best_val_nll == min(r.best_val_nll for r in results)
    source = candidate_paths(RunPaths(run), kept.name)
    for name in ("config.toml", "metrics.jsonl", "checkpoints/best.pt", "checkpoints/last.pt"):
        assert (run / name).read_bytes() == (source.root / name).read_bytes(), name
    stored = TrainConfig.from_toml(RunPaths(run).config)
    assert stored.alternative == "none"  # a plain run of the kept model
    expected = dict(candidates(SELECTING, 12))[kept.name]
    assert (stored.model.layers, stored.model.conditioner, stored.lr) == (
        expected.model.layers, expected.model.conditioner, expected.lr)
    for result in results:  # each candidate is the run its settings give on their own
        folder = candidate_paths(RunPaths(run), result.name)
        history = load_checkpoint(folder.last)["history"]
        assert min(row["val_nll"] for row in history) == result.best_val_nll
        assert len(history) == result.epochs == 2


def test_each_candidate_trains_as_a_run_of_its_settings_alone(run: Path, tmp_path: Path) -> None:
    settings = dict(candidates(SELECTING, 12))["recurrent"]
    alone = train(settings, tmp_path / "alone", progress=False)
    inside = load_checkpoint(candidate_paths(RunPaths(run), "recurrent").best)
    mine = load_checkpoint(alone.paths.best)
    assert [row["val_nll"] for row in mine["history"]] == [
        row["val_nll"] for row in inside["history"]]
    for key, value in mine["model"].items():
        assert torch.equal(value, inside["model"][key]), key


def test_fit_chooses_as_train_does(run: Path) -> None:
    result = fit(SELECTING, load_data(SELECTING))
    assert result.selection == read_selection(RunPaths(run))
    kept = choose(result.selection).name
    assert result.config == dict(candidates(SELECTING, 12))[kept]
    best = load_checkpoint(RunPaths(run).best)["model"]
    for key, value in result.model.state_dict().items():
        assert torch.equal(value, best[key]), key


def test_a_selection_cut_short_resumes_each_candidate(run: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut"
    (cut / "candidates").mkdir(parents=True)
    SELECTING.save(RunPaths(cut).config)  # the given settings, as the run writes them first
    shutil.copytree(run / "candidates" / "configured", cut / "candidates" / "configured")
    resumed = train(SELECTING, cut, resume=True, progress=False)
    assert resumed.selection == read_selection(RunPaths(run))
    assert (cut / "checkpoints" / "best.pt").is_file()
    for name in ("configured", "recurrent", "maf"):
        ours = load_checkpoint(candidate_paths(RunPaths(cut), name).last)["history"]
        theirs = load_checkpoint(candidate_paths(RunPaths(run), name).last)["history"]
        assert [r["val_nll"] for r in ours] == [r["val_nll"] for r in theirs], name


def test_a_finished_selection_resumes_its_kept_model(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    kept = choose(read_selection(RunPaths(copy)) or ()).name
    config = TrainConfig.from_toml(RunPaths(copy).config).replace(epochs=3)
    result = train(config, copy, resume=True, progress=False)
    assert result.epochs == 3 and result.selection == ()
    assert load_checkpoint(RunPaths(copy).last)["config"]["lr"] == (
        dict(candidates(SELECTING, 12))[kept].lr)


def test_bad_settings_of_a_candidate_leave_the_folder_untouched(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="heads must divide"):
        train(SELECTING.replace(model=SELECTING.model.replace(heads=5)), out, progress=False)
    assert not out.exists()
    with pytest.raises(Exception, match="checkpoint not found"):
        train(SELECTING, tmp_path / "nothing", resume=True, progress=False)


def test_runs_written_before_the_setting_train_one_model(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "old"
    shutil.copytree(run, copy)
    paths = forget_setting(copy, "alternative")
    assert TrainConfig.from_toml(paths.config, stored=True).alternative == "none"


def test_the_cli_reports_every_candidate(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    argv = ["train", "--out", str(out), "--n-blocks", "1", "--hidden", "8", "--max-train", "12",
            "--max-eval", "6", "--batch-size", "6", "--epochs", "2", "--min-steps", "1",
            "--scheduler", "plateau", "--eval-method", "exact", "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("candidates: configured ")
    assert "recurrent" in printed.splitlines()[0] and "maf" in printed.splitlines()[0]
    assert "kept: trained 2 epochs" in printed
    assert main(["info", str(out)]) == 0
    assert "candidates: configured" in capsys.readouterr().out
    assert main(argv[:-1] + ["--alternative", "none", "--overwrite", "--quiet"]) == 0
    assert not (out / "candidates").exists() and "candidates" not in capsys.readouterr().out
