"""The forecast benchmark's forecasters and tables: the AR(p) draws against the closed-form
conditional, seasonal naive, the GRU + MAF's frame-by-frame forecast, ETS, the tables."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from benchmarks import cli, forecast, records
from benchmarks.baselines.forecasters import (
    ar_forecast,
    choose_period,
    ets_forecast,
    seasonal_naive,
)
from benchmarks.baselines.recurrent import ENCODERS, RecurrentFlow
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.runs.forecast import forecast_run, hold_out
from iresflow.runs.load import load_run


def test_ar_draws_follow_the_closed_form_conditional() -> None:
    generator = torch.Generator().manual_seed(0)
    series = torch.zeros(400, 12, 1, dtype=torch.float64)
    for t in range(1, 12):  # x_t = 0.5 + 0.8 x_{t-1} + 0.3 e_t
        noise = torch.randn(400, 1, generator=generator, dtype=torch.float64)
        series[:, t] = 0.5 + 0.8 * series[:, t - 1] + 0.3 * noise
    model = AutoregressiveGaussian(1, 12).fit(series, order=1)
    past = series[:3, :8]
    observed = torch.ones(3, 8, dtype=torch.bool)
    draws = ar_forecast(model, past, observed, 2, 20000, torch.Generator().manual_seed(1))
    weight, bias, scale = model.weight[1, 0, 0], model.bias[1, 0], model.scale_tril[1, 0, 0]
    mean = bias + weight * past[:, -1, 0]  # first step
    z = (draws[:, :, 0, 0].mean(0) - mean) / (scale / math.sqrt(20000))
    assert bool((z.abs() < 4).all()), z
    assert torch.allclose(draws[:, :, 0, 0].std(0), scale.expand(3), rtol=0.03)
    second = bias * (1 + weight) + weight**2 * past[:, -1, 0]  # two steps ahead
    assert torch.allclose(draws[:, :, 1, 0].mean(0), second, atol=5 * scale / math.sqrt(20000)
                          * math.sqrt(1 + weight**2))


def test_ar_draws_of_short_histories_use_the_sub_models_of_fewer_lags() -> None:
    model = AutoregressiveGaussian(2, 6).fit(torch.randn(50, 6, 2, dtype=torch.float64), order=2)
    x = torch.randn(2, 4, 2, dtype=torch.float64)
    observed = torch.tensor([[True, False, False, False], [True, True, True, True]])
    draws = ar_forecast(model, x, observed, 3, 4, torch.Generator().manual_seed(0))
    assert draws.shape == (4, 2, 3, 2) and bool(draws.isfinite().all())
    independent = AutoregressiveGaussian(2, 6).fit(torch.randn(50, 6, 2, dtype=torch.float64),
                                                   order=0)
    draws = ar_forecast(independent, x, observed, 3, 5000, torch.Generator().manual_seed(0))
    assert torch.allclose(draws.mean((0, 1, 2)), independent.bias[0], atol=0.1)


def test_seasonal_naive_chooses_the_true_period() -> None:
    season = torch.tensor([0.0, 3.0, 1.0, -2.0, 5.0], dtype=torch.float64)
    x = season.repeat(4)[None, :, None].expand(3, -1, -1).clone()  # (3, 20, 1)
    observed = torch.arange(20) < torch.tensor([[12], [15], [13]])
    start = observed.sum(1)
    truth = torch.stack([x[b, start[b]:start[b] + 4] for b in range(3)])
    assert choose_period(x, observed, truth, torch.ones(3, 4, dtype=torch.bool)) == 5
    assert torch.equal(seasonal_naive(x, observed, 4, 5)[0], truth)


@pytest.mark.parametrize("encoder", ENCODERS)
def test_recurrent_forecast_ignores_padding_and_follows_its_seed(encoder: str) -> None:
    torch.manual_seed(0)
    model = RecurrentFlow(2, max_len=10, hidden=8, n_layers=2, encoder=encoder).double().eval()
    with torch.no_grad():  # away from the zero start of the Transformer's output layer
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 5, 2, dtype=torch.float64)
    mask = torch.arange(8) < torch.tensor([[5], [3]])
    padded = torch.where(mask[..., None], torch.cat([x, torch.zeros(2, 3, 2)], 1), 1e3)
    draws = model.forecast(padded, mask, 3, 6, torch.Generator().manual_seed(2))
    assert draws.shape == (6, 2, 3, 2)
    # frame by frame: the MAF's inverse of the generator's noise given the encoder's output
    # for the observed frames and the frames drawn before it, the encoder rerun on each prefix
    generator = torch.Generator().manual_seed(2)
    noise = [torch.randn(12, 2, dtype=torch.float64, generator=generator) for _ in range(3)]
    for b, length in enumerate((5, 3)):
        for s in range(6):
            prefix = x[b, :length]
            for h in range(3):
                rows = torch.cat([prefix, torch.zeros(1, 2, dtype=torch.float64)])
                context = model.past(rows[None])[:, -1]
                frame = model.flow._transform.inverse(noise[h][s * 2 + b][None],
                                                      context)[0][0]
                torch.testing.assert_close(draws[s, b, h], frame)
                prefix = torch.cat([prefix, frame[None]])


def test_ets_forecasts_univariate_series_and_refuses_others() -> None:
    pytest.importorskip("statsmodels")
    trend = torch.arange(30, dtype=torch.float64)[None, :, None] * 0.5
    observed = torch.ones(1, 30, dtype=torch.bool)
    draws = ets_forecast(trend, observed, 4, 50, seed=0)
    assert draws.shape == (50, 1, 4, 1)
    assert abs(float(draws[:, 0, 0, 0].median()) - 15.0) < 0.5  # the line continues
    with pytest.raises(ValueError, match="univariate"):
        ets_forecast(torch.zeros(1, 30, 2), observed, 4, 5, seed=0)


def _record(name: str, seed: int, flow: float) -> dict:
    scores = {"crps_mean": 1.0, "coverage": {"50": 0.5, "90": 0.9}, "seconds": 1.0}
    return {"dataset": name, "seed": seed, "horizon": 6, "sequences": 10,
            "seasonal_naive": scores, "ar": {**scores, "crps_mean": 0.8},
            "flow": {**scores, "crps_mean": flow, "test_nll": 1.5, "epochs": 60,
                     "best_epoch": 60 if seed else 41}}


def test_tables_bold_the_best_and_compare_with_the_default_nll() -> None:
    rows = [_record("GunPoint", 0, 0.5), _record("GunPoint", 1, 0.7)]
    default = {"records": [{"dataset": "GunPoint", "flow": {"test_nll": 1.4}}]}
    tables = forecast.markdown_tables(rows, default)
    crps_row = tables["forecast-crps"].splitlines()[2]
    assert "**0.6000 ± 0.1414 (90%)**" in crps_row and "0.8000 ± 0.0000 (90%)" in crps_row
    assert "| GunPoint | 1.500 ± 0.000 | 1.400 | +0.100 | 1 of 2 |" in tables["forecast-nll"]


def test_the_scores_tables_go_into_the_blocks_named(tmp_path) -> None:
    records.save(tmp_path / "r.json", [_record("GunPoint", 0, 0.5)], ["run"], {})
    page = tmp_path / "page.md"
    markers = [f"<!-- {name}:{end} -->" for name in ("forecast-crps", "other-crps",
                                                       "other-nll") for end in ("start", "end")]
    page.write_text("\n".join(markers) + "\n")
    assert cli.main(["forecast", "--table-from", str(tmp_path / "r.json"), "--block", "other",
                     "--doc", str(page)]) == 0
    text = page.read_text()
    assert "<!-- forecast-crps:start -->\n<!-- forecast-crps:end -->" in text  # untouched
    for name in ("other-crps", "other-nll"):
        block = text.split(f"<!-- {name}:start -->")[1].split(f"<!-- {name}:end -->")[0]
        assert "| GunPoint |" in block


def test_the_noise_table_lists_every_forecast_with_both_noises() -> None:
    chose = _record("co2_windows", 1, 0.5)
    chose["flow"] |= {"kept": "recurrent", "noise": "prior",
                      "noise_validation": {"given": 0.61, "prior": 0.6},
                      "given_noise": {"crps_mean": 0.55}, "prior_noise": {"crps_mean": 0.5}}
    older = _record("GunPoint", 0, 0.7)
    older["flow"] |= {"given_noise": {"crps_mean": 0.7}, "prior_noise": {"crps_mean": 0.9}}
    table = forecast.noise_table([chose, _record("GunPoint", 2, 0.4), older]).splitlines()
    assert len(table) == 4  # the record without both noises is left out
    assert table[2] == "| GunPoint | 0 | — | **0.7** | 0.9 | — | AR(p) Gaussian 0.8 |"
    assert table[3] == ("| co2_windows | 1 | recurrent | 0.55 | **0.5** | prior (0.61 / 0.6) | "
                        "AR(p) Gaussian 0.8 |")
    chose["flow"] |= {"candidate": "configured", "validation": {
        "recurrent/given": 0.61, "recurrent/prior": 0.6, "configured/given": 0.58,
        "configured/prior": 0.59}}
    del chose["flow"]["noise_validation"]
    assert forecast.noise_table([chose]).splitlines()[2] == table[3]  # the kept model's choice


def test_the_candidates_table_sets_the_kept_models_forecast_beside_the_chosen_ones() -> None:
    chose = _record("co2_windows", 1, 0.45)
    chose["flow"] |= {"kept": "recurrent", "candidate": "configured", "noise": "given",
                      "validation": {"recurrent/given": 0.61, "recurrent/prior": 0.6,
                                     "configured/given": 0.58, "configured/prior": 0.59},
                      "given_noise": {"crps_mean": 0.55}, "prior_noise": {"crps_mean": 0.5},
                      "latency": 0.0512, "peer_latency": 0.0734}
    alone = _record("GunPoint", 0, 0.7)
    alone["flow"] |= {"kept": None, "candidate": "kept", "noise": "given",
                      "validation": {"kept/given": 0.3, "kept/prior": 0.4},
                      "given_noise": {"crps_mean": 0.7}, "prior_noise": {"crps_mean": 0.9}}
    unscored = _record("GunPoint", 1, 0.6)
    unscored["flow"] |= {"kept": None, "candidate": "kept", "noise": "given", "validation": None}
    table = forecast.candidates_table([chose, alone, _record("GunPoint", 2, 0.4),
                                       unscored]).splitlines()
    assert len(table) == 4  # the records without a choice are left out
    assert table[2] == "| GunPoint | 0 | — | given | 0.7 | kept, given | 0.7 | 1 | 0.8 | — | — |"
    assert table[3] == ("| co2_windows | 1 | recurrent | prior | 0.5 | configured, given | "
                        "**0.45** | 1 | 0.8 | — | 0.051 / 0.073 |")


def test_the_causal_flow_takes_the_settings_of_an_ablation(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path) -> None:
    args = cli.parse(["forecast", "--datasets", "co2_windows", "--set",
                      'layers=["autoregressive","mlp"]'])
    assert cli.settings(args) == {"layers": ["autoregressive", "mlp"]}
    trained = []

    class Stop(Exception):
        """The run itself is not needed."""

    def stop(config, *rest, **options):
        trained.append(config)
        raise Stop

    monkeypatch.setattr(forecast, "train", stop)
    with pytest.raises(Stop):
        forecast.run_flow("co2_windows", None, 0, 4, 2, tmp_path, None, cli.settings(args))
    (config,) = trained
    assert config.model.causal and config.model.layers == ("autoregressive", "mlp")


def test_the_flow_record_names_the_candidate_kept(tmp_path) -> None:
    tiny = {"n_blocks": 1, "hidden": 8, "max_train": 12, "max_eval": 6, "batch_size": 6,
            "epochs": 1, "min_steps": 1, "device": "cpu"}
    ds = forecast.load("co2_windows", 0)
    ds = dataclasses.replace(ds, test=ds.test.subset(torch.arange(2)))
    held = hold_out(ds.test, 4)
    record = forecast.run_flow("co2_windows", ds, 0, 4, 2, tmp_path / "a", held, tiny)
    assert record["kept"] in ("configured", "recurrent")  # one feature: two candidates
    given, prior = record["given_noise"], record["prior_noise"]  # the kept model's noises
    assert prior["frames"] == record["frames"] and prior["crps_mean"] != given["crps_mean"]
    assert list(record["validation"]) == [f"{name}/{noise}" for name in (
        record["kept"], ({"configured", "recurrent"} - {record["kept"]}).pop())
        for noise in ("given", "prior")]
    chosen = min(record["validation"], key=record["validation"].__getitem__)
    assert f"{record['candidate']}/{record['noise']}" == chosen
    if record["candidate"] == record["kept"]:
        assert record[f"{record['noise']}_noise"]["crps_mean"] == record["crps_mean"]
    alone = forecast.run_flow("co2_windows", ds, 0, 4, 2, tmp_path / "b", held,
                              {**tiny, "alternative": "none"})
    assert alone["kept"] is None


def test_runs_keeps_every_trained_run_to_forecast_again(tmp_path) -> None:
    """(Frames of several features: no ETS, which needs the benchmarks extra.)"""
    tiny = ["n_blocks=1", "hidden=8", "max_train=12", "max_eval=6", "batch_size=6", "epochs=1",
            "min_steps=1", "device=cpu", "alternative=none"]
    args = cli.parse(["forecast", "--datasets", "japanese_vowels", "--budget", "0",
                      "--max-sequences", "2", "--num", "2", "--out", str(tmp_path / "r.json"),
                      "--runs", str(tmp_path / "runs"), "--set", *tiny])
    assert forecast.run(args) == 0
    (record,) = records.load(tmp_path / "r.json")["records"]
    run = load_run(tmp_path / "runs" / "japanese_vowels-seed0")
    test = forecast.load("japanese_vowels", 0).test.subset(torch.arange(2))
    again = forecast_run(dataclasses.replace(run, dataset=dataclasses.replace(
        run.dataset, test=test)), horizon=record["horizon"], num=2)
    assert again.scores["crps_mean"] == record["flow"]["crps_mean"]
    reforecast = cli.parse(["forecast", "--datasets", "japanese_vowels", "--max-sequences", "2",
                            "--out", str(tmp_path / "r.json"), "--runs", str(tmp_path / "runs"),
                            "--reforecast"])
    assert forecast.run(reforecast) == 0
    stored = records.load(tmp_path / "r.json")
    (again,) = stored["records"]
    assert record["flow"]["latency"] > 0 and record["flow"]["peer_latency"] > 0
    timings = ("seconds", "latency", "peer_latency")
    assert {k: v for k, v in again["flow"].items() if k not in timings} == {
        k: v for k, v in record["flow"].items() if k not in timings}
    assert again | {"flow": None} == record | {"flow": None} and len(stored["commands"]) == 2
    with pytest.raises(SystemExit, match="no record with a flow or no run"):
        forecast.run(cli.parse(["forecast", "--datasets", "GunPoint", "--reforecast",
                                "--out", str(tmp_path / "r.json"), "--runs",
                                str(tmp_path / "runs")]))
