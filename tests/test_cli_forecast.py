"""``iresflow forecast`` and the frame scores of ``iresflow evaluate --scores`` on causal runs:
the held-out frames and their scores, a file's future, reproducibility, the refusals."""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.cli import main
from iresflow.data.datasets import load_dataset
from iresflow.runs.evaluate import frame_scores
from iresflow.runs.forecast import forecast_run, hold_out
from iresflow.runs.load import load_candidate, load_run
from iresflow.runs.scoring import QUANTILES
from iresflow.train.config import ConfigError

TINY = [
    "--n-blocks", "1", "--hidden", "8", "--max-train", "12", "--max-eval", "6",
    "--batch-size", "6", "--scheduler", "plateau", "--eval-method", "exact", "--quiet",
    "--epochs", "1", "--data", "japanese_vowels",
]


@pytest.fixture(scope="module")
def causal_run(tmp_path_factory: pytest.TempPathFactory, device: torch.device) -> Path:
    out = tmp_path_factory.mktemp("forecast") / "causal"
    assert main(["train", *TINY, "--causal", "--out", str(out), "--device", str(device)]) == 0
    return out


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory, device: torch.device) -> Path:
    out = tmp_path_factory.mktemp("forecast") / "plain"
    assert main(["train", *TINY, "--out", str(out), "--device", str(device)]) == 0
    return out


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_forecast_holds_out_the_last_frames_and_scores_them(
    causal_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f.npz"
    assert main(["forecast", str(causal_run), "--horizon", "3", "--num", "8",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CRPS" in printed and "converged" in printed and out.with_suffix(".png").is_file()
    saved = np.load(out)
    run = load_run(causal_run)
    test = run.dataset.test
    lengths = test.mask.sum(1).numpy()
    index = saved["index"]
    assert saved["samples"].shape == (8, len(index), 3, 12)
    assert np.array_equal(saved["start"], lengths[index] - 3)  # no gaps in these data
    raw = run.dataset.to_raw(test.x, test.mask).numpy()
    for row, k in enumerate(index):
        start = saved["start"][row]
        assert np.allclose(saved["truth"][row], raw[k, start:start + 3], atol=1e-5)
        assert saved["mask"][row].sum() == start and saved["truth_mask"][row].all()
    assert np.array_equal(saved["levels"], np.array(QUANTILES, dtype=np.float32))
    assert (np.diff(saved["quantiles"], axis=0) >= 0).all()
    assert saved["crps"].shape == (12,) and (saved["crps"] > 0).all()
    assert 0.0 <= float(saved["coverage_90"]) <= 1.0 and np.isfinite(saved["energy"])
    assert "scale of the new frames' noise given the observed ones" in printed
    assert saved["scale"].shape == (len(index),) and (saved["scale"] > 0).all()


def test_forecast_is_reproducible_by_its_seed(causal_run: Path) -> None:
    run = load_run(causal_run)
    first, again = (forecast_run(run, horizon=2, num=4, seed=3) for _ in range(2))
    other = forecast_run(run, horizon=2, num=4, seed=4)
    assert torch.equal(first.samples, again.samples)
    assert not torch.equal(first.samples, other.samples)
    assert first.scores is not None and first.scores["frames"] == 2 * len(first.index)


def test_forecast_with_prior_noise_is_the_flow_solved_for_new_noise_that_ignores_the_past(
    causal_run: Path, tmp_path: Path
) -> None:
    """``--noise prior`` writes the draws of ``forecast_run(noise="prior")``: the flow's
    forecast with the new frames' noise from ``sample_new``, not the conditional t."""
    out = tmp_path / "prior.npz"
    assert main(["forecast", str(causal_run), "--horizon", "2", "--num", "4", "--seed", "3",
                 "--noise", "prior", "--out", str(out)]) == 0
    run = load_run(causal_run)
    prior = forecast_run(run, horizon=2, num=4, seed=3, noise="prior")
    given = forecast_run(run, horizon=2, num=4, seed=3, noise="given")
    np.testing.assert_array_equal(np.load(out)["samples"], prior.samples.numpy())
    assert not torch.equal(prior.samples, given.samples)


def _candidates(run_dir: Path) -> tuple[str, list[str]]:
    """The kept candidate of a run and all of its candidates, the kept one first."""
    selection = json.loads((run_dir / "selection.json").read_text())
    names = [c["name"] for c in selection["candidates"]]
    return selection["kept"], [selection["kept"]] + [n for n in names if n != selection["kept"]]


def test_auto_forecast_draws_with_the_candidate_and_noise_of_the_lowest_validation_crps(
    causal_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default (``candidate`` and ``noise`` ``auto``) every candidate the run trained
    forecasts the validation split's last frames (from three origins) with each noise, and the
    forecast is drawn by the option of the lowest CRPS: bit-identical to that candidate's own
    run asked for it."""
    out = tmp_path / "auto.npz"
    assert main(["forecast", str(causal_run), "--horizon", "2", "--num", "4", "--seed", "3",
                 "--out", str(out)]) == 0
    kept, names = _candidates(causal_run)
    assert len(names) == 3  # configured, recurrent, maf: twelve features
    alone = {name: load_run(causal_run / "candidates" / name) for name in names}
    validation = {f"{name}/{noise}": forecast_run(
        alone[name], horizon=2, num=4, seed=3, split="val", noise=noise, candidate="kept",
        origins=3).scores["crps_mean"] for name in names for noise in ("given", "prior")}
    assert len(set(validation.values())) == 6
    name, noise = min(validation, key=validation.__getitem__).split("/")
    auto = forecast_run(load_run(causal_run), horizon=2, num=4, seed=3)
    assert (auto.candidate, auto.noise, auto.validation_crps) == (name, noise, validation)
    assert torch.equal(auto.samples, forecast_run(alone[name], horizon=2, num=4, seed=3,
                                                  noise=noise, candidate="kept").samples)
    saved = np.load(out)
    assert (str(saved["candidate"]), str(saved["noise"])) == (name, noise)
    assert np.array_equal(saved["samples"], auto.samples)
    assert saved["options"].tolist() == list(validation)
    np.testing.assert_array_equal(saved["validation_crps"], list(validation.values()))
    printed = capsys.readouterr().out
    assert f"drawn by the {name} candidate (epoch {alone[name].epoch}), noise of the new " \
           f"frames: {noise}\nchosen on the validation split, CRPS {names[0]}/given" in printed


def test_a_forecast_of_a_named_candidate_or_noise_chooses_the_rest_only(
    causal_run: Path,
) -> None:
    run = load_run(causal_run)
    kept, names = _candidates(causal_run)
    other = names[1]
    fixed = forecast_run(run, horizon=2, num=4, seed=3, candidate=other, noise="prior")
    assert (fixed.candidate, fixed.noise, fixed.validation_crps) == (other, "prior", None)
    alone = load_run(causal_run / "candidates" / other)
    assert torch.equal(fixed.samples, forecast_run(alone, horizon=2, num=4, seed=3,
                                                   candidate="kept", noise="prior").samples)
    own = forecast_run(run, horizon=2, num=4, seed=3, candidate="kept")
    assert own.candidate == kept and list(own.validation_crps) == [f"{kept}/given",
                                                                   f"{kept}/prior"]
    assert torch.equal(own.samples, forecast_run(run, horizon=2, num=4, seed=3, candidate=kept)
                       .samples)
    noises = forecast_run(run, horizon=2, num=4, seed=3, noise="given")
    assert list(noises.validation_crps) == [f"{name}/given" for name in names]


def test_a_candidate_without_a_checkpoint_is_no_option(causal_run: Path, tmp_path: Path) -> None:
    kept, names = _candidates(causal_run)
    gone = next(name for name in names if name != kept)
    copy = tmp_path / "run"
    shutil.copytree(causal_run, copy)
    shutil.rmtree(copy / "candidates" / gone)
    run = load_run(copy)
    forecast = forecast_run(run, horizon=2, num=4, seed=3, noise="given")
    assert list(forecast.validation_crps) == [f"{n}/given" for n in names if n != gone]
    with pytest.raises(ConfigError, match=f"holds no trained candidate '{gone}'"):
        forecast_run(run, horizon=2, num=4, candidate=gone)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint of the candidate '{gone}'"):
        load_candidate(run, gone)


def test_a_run_of_one_model_forecasts_with_it_and_names_no_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "alone"
    assert main(["train", *TINY, "--causal", "--alternative", "none", "--out", str(out)]) == 0
    forecast = forecast_run(load_run(out), horizon=2, num=4, seed=3)
    assert forecast.candidate == "kept" and list(forecast.validation_crps) == [
        "kept/given", "kept/prior"]
    assert main(["forecast", str(out), "--horizon", "2", "--num", "4",
                 "--out", str(tmp_path / "f.npz")]) == 0
    assert "drawn by the run's model (epoch 1)" in capsys.readouterr().out
    assert main(["forecast", str(out), "--candidate", "maf"]) == 1
    assert "holds no trained candidate 'maf': its models are kept" in _error_line(capsys)


def test_auto_without_a_validation_sequence_to_score_draws_with_the_kept_model_and_given_noise(
    causal_run: Path,
) -> None:
    run = load_run(causal_run)
    val, test = run.dataset.val, run.dataset.test
    shorter = val.subset((val.frames < test.frames.max()).nonzero().flatten())
    horizon = int(shorter.frames.max())  # no validation frame before the last H
    run = dataclasses.replace(run, dataset=dataclasses.replace(run.dataset, val=shorter))
    forecast = forecast_run(run, horizon=horizon, num=4, seed=3)
    kept, _ = _candidates(causal_run)
    assert (forecast.candidate, forecast.noise, forecast.validation_crps) == (kept, "given", None)
    assert torch.equal(forecast.samples, forecast_run(run, horizon=horizon, num=4, seed=3,
                                                      candidate="kept", noise="given").samples)
    assert forecast_run(run, horizon=horizon - 1, num=4, seed=3).validation_crps is not None


def test_forecast_reports_the_scale_the_observed_noise_gives_the_new_noise(
    causal_run: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sequence-level t of the run: sqrt((nu + q_o) / (nu + k_o)) of the observed frames'
    noise; a base that does not report it leaves it out."""
    run = load_run(causal_run)
    forecast = forecast_run(run, horizon=2, num=4, seed=3, candidate="kept")
    held = hold_out(run.dataset.test, 2)
    x = torch.where(held.observed[..., None], held.x, 0.0).to(next(run.model.parameters()))
    with torch.no_grad():
        z = run.model.transform_to_noise(x, held.observed.to(x.device)).cpu().double()
    nu = float(run.model.base.nu.detach())
    square = (z.square().sum(-1) * held.observed).sum(1)
    known = held.observed.sum(1) * z.shape[-1]
    assert forecast.scale is not None
    torch.testing.assert_close(forecast.scale.double(), ((nu + square) / (nu + known)).sqrt(),
                               rtol=1e-4, atol=0.0)

    def silent(z: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    monkeypatch.setattr(run.model.base, "given_scale", silent)
    assert forecast_run(run, horizon=2, num=4, seed=3, candidate="kept").scale is None


def test_several_origins_hold_out_every_window_before_the_last_frames_too(
    causal_run: Path,
) -> None:
    test = load_run(causal_run).dataset.test
    held = hold_out(test, 2, origins=3)
    end = test.mask.sum(1)  # no gaps in these data
    expected = sorted((b, int(end[b]) - 2 * k) for k in range(1, 4) for b in range(len(test))
                      if end[b] - 2 * k >= 1)
    rows = list(zip(held.index.tolist(), held.start.tolist(), strict=True))
    assert sorted(rows) == expected
    positions = torch.arange(held.x.shape[1])
    for row, (b, start) in enumerate(rows):
        assert torch.equal(held.observed[row], test.mask[b, :held.x.shape[1]]
                           & (positions < start))
        assert torch.equal(held.truth[row], test.x[b, start:start + 2])
    assert torch.equal(held.index[:len(test)], torch.arange(len(test)))  # the last windows first
    forecast = forecast_run(load_run(causal_run), horizon=2, num=4, seed=3, candidate="kept",
                            noise="given", origins=3)
    assert torch.equal(forecast.index, held.index)
    assert forecast.scores is not None and forecast.scores["frames"] == 2 * len(held.index)


def test_forecast_of_a_file_continues_every_sequence(causal_run: Path, tmp_path: Path) -> None:
    dataset = load_dataset("japanese_vowels")
    raw = dataset.to_raw(dataset.test.x[:2], dataset.test.mask[:2])
    x = np.zeros((2, 8, 12), dtype=np.float32)
    x[0, :5], x[1] = raw[0, :5].numpy(), raw[1, :8].numpy()
    data = tmp_path / "recent.npz"
    np.savez(data, x=x, lengths=np.array([5, 8]))
    out = tmp_path / "future.npz"
    assert main(["forecast", str(causal_run), "--data", str(data), "--horizon", "4",
                 "--num", "6", "--out", str(out)]) == 0
    saved = np.load(out)
    assert saved["samples"].shape == (6, 2, 4, 12) and saved["start"].tolist() == [5, 8]
    assert "truth" not in saved and np.allclose(saved["observed"][0, :5], x[0, :5], atol=1e-4)


@pytest.mark.parametrize(("flags", "message"), [
    (["--num", "1"], "num must be >= 2, got 1"),
    (["--horizon", "0"], "horizon must be >= 1, got 0"),
    (["--temperature", "0"], "temperature must be > 0"),
    (["--out", "forecast.txt"], "--out must end in .npz"),
    (["--plot-sequence", "99"], "plot_sequence must be in [0, "),
    (["--horizon", "40"], "no sequence of the split has more than horizon = 40 frames"),
    (["--data", "series.xlsx"], "data must be a .npz, .ts, .csv or .parquet file"),
    (["--data", "series.npz", "--origins", "2"], "origins applies to the held-out frames"),
])
def test_bad_forecast_requests_end_with_one_line(
    causal_run: Path, flags: list[str], message: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = [str(tmp_path / flag) if flag.endswith(".txt") else flag for flag in flags]
    assert main(["forecast", str(causal_run), *flags]) == 1
    assert message in _error_line(capsys)


def test_a_long_file_is_conditioned_on_its_latest_frames(
    causal_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    longest = load_run(causal_run).model.max_len
    data = tmp_path / "long.npz"
    x = np.random.default_rng(0).standard_normal((2, longest + 5, 12)).astype(np.float32)
    x[1, longest:] = 0.0
    np.savez(data, x=x, lengths=np.array([longest + 5, longest]))
    out = tmp_path / "long_forecast.npz"
    assert main(["forecast", str(causal_run), "--data", str(data), "--horizon", "2",
                 "--num", "3", "--out", str(out)]) == 0
    saved = np.load(out)
    assert saved["start"].tolist() == [longest - 2, longest - 2]
    assert np.allclose(saved["observed"][0], x[0, 7:longest + 5], atol=1e-4)
    assert np.allclose(saved["observed"][1], x[1, 2:longest], atol=1e-4)
    assert main(["forecast", str(causal_run), "--data", str(data), "--horizon",
                 str(longest)]) == 1
    assert "leaves no frame to condition on" in _error_line(capsys)
    np.savez(data, x=np.ones((1, 4, 3), dtype=np.float32))
    assert main(["forecast", str(causal_run), "--data", str(data)]) == 1
    assert "has 3 features per frame, the run 12" in _error_line(capsys)


def test_a_run_that_is_not_causal_does_not_forecast(
    plain_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["forecast", str(plain_run)]) == 1
    assert "is not causal: only a run trained with causal = true" in _error_line(capsys)
    with pytest.raises(ValueError, match="frame scores need a run trained with causal"):
        frame_scores(load_run(plain_run), "test")


def test_evaluate_scores_every_frame_of_a_causal_run(
    causal_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scores = tmp_path / "scores.csv"
    assert main(["evaluate", str(causal_run), "--scores", str(scores), "--no-reference"]) == 0
    frames_file = tmp_path / "scores_frames.csv"
    assert str(frames_file) in capsys.readouterr().out
    assert (tmp_path / "scores_frames.png").is_file()
    with scores.open() as file:
        sequences = list(csv.DictReader(file))
    with frames_file.open() as file:
        frames = list(csv.DictReader(file))
    assert len(frames) == sum(int(row["length"]) for row in sequences)
    for row in sequences:
        mine = [float(f["log_prob"]) for f in frames if f["index"] == row["index"]]
        assert sum(mine) == pytest.approx(float(row["log_prob"]), abs=1e-3)
        nll = [float(f["nll"]) for f in frames if f["index"] == row["index"]]
        assert np.mean(nll) == pytest.approx(float(row["nll"]), abs=1e-4)
    archive = tmp_path / "scores.npz"
    assert main(["evaluate", str(causal_run), "--scores", str(archive), "--no-reference"]) == 0
    saved = np.load(archive)
    run = load_run(causal_run)
    assert saved["frame_nll"].shape == (len(run.dataset.test), run.dataset.max_len)
    assert np.array_equal(np.isnan(saved["frame_nll"]), ~run.dataset.test.mask.numpy())
    assert np.allclose(np.nansum(saved["frame_log_prob"], 1), saved["log_prob"], atol=1e-3)


def test_frame_nll_sums_to_the_sequence_nll_under_every_preprocessing() -> None:
    generator = torch.Generator().manual_seed(0)
    for name in ("japanese_vowels", "digits_rows"):  # standardised; logit of pixels, bits/dim
        dataset = load_dataset(name)
        split = dataset.test
        x, mask = split.x[:5].double(), split.mask[:5]
        per_frame = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
        per_frame = torch.where(mask, per_frame, 0.0)
        nll = dataset.frame_nll(per_frame, x, mask)
        sequences = dataset.sequence_nll(per_frame.sum(1), split.subset(torch.arange(5)))
        frames = mask.sum(1).double()
        assert torch.allclose(nll.nansum(1), sequences * frames, atol=1e-8), name
        assert bool(nll.isnan().eq(~mask).all())
