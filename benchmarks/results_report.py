"""The pages of the results table (:mod:`benchmarks.results`): its Markdown blocks, the target
check and which command produced which rows.

A file of the table (:mod:`benchmarks.records`) holds one record per dataset: the dataset's
facts (unit, sizes, parameter target) and one entry per model key of
:data:`~benchmarks.results_specs.SPECS`; its settings are the mode and budget, its ``machine``
the threads, jobs and wall time of the last run.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.records import markdown_table
from benchmarks.results_specs import DATASETS, MAX_AR_ORDER, PARALLEL_PEERS, SPECS

#: The blocks of the results pages: the tables (also in the README), which command produced
#: which rows, and the protocol.
BLOCKS = ("results", "results-provenance", "results-protocol")
#: The trainer of the rows this version of the benchmark trains.
TRAINER = "`iresflow.train.fit.fit`"
#: The trainer of rows stored before the benchmarks trained through ``iresflow train``'s loop.
EARLIER_TRAINER = "`fit_model` of the former `benchmarks/baselines/training.py`"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation over seeds of the numbers of a row."""
    good = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"seeds": len(good), "errors": [r["error"] for r in runs if "error" in r]}
    if not good:
        return out
    for field in ("test_nll", "val_nll", "seconds_per_epoch", "sample_seconds_per_sequence",
                  "epochs", "test_nll_roulette"):
        values = [r[field] for r in good if isinstance(r.get(field), int | float)]
        if values:
            out[field] = statistics.fmean(values)
            out[field + "_std"] = statistics.stdev(values) if len(values) > 1 else None
    errors = [r["test_nll_roulette_stderr"] for r in good if "test_nll_roulette_stderr" in r]
    if errors:  # standard error of the mean over seeds of independent estimates
        out["test_nll_roulette_stderr"] = math.sqrt(sum(e * e for e in errors)) / len(errors)
    out["params"] = good[0]["params"]
    out["test_divergence"] = good[0].get("test_divergence")
    out["order"] = good[0].get("order")
    return out


def entries(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{dataset: {model: entry}}`` of the records, datasets and models in the table's order."""
    ordered = sorted(rows, key=lambda r: DATASETS.index(r["dataset"]))
    return {r["dataset"]: {key: r[key] for key in SPECS if key in r} for r in ordered}


def target_check(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Does iresflow (the default recipe) have the best test NLL on >= 2 of 3 datasets, and the
    best among the parallel samplers (iresflow, RealNVP, CNF) on every dataset?"""
    per_dataset = {}
    for name, per_model in entries.items():
        means = {key: e["summary"]["test_nll"] for key, e in per_model.items()
                 if e["status"] == "ok" and "test_nll" in e.get("summary", {})}
        if "iresflow" not in means:
            per_dataset[name] = {"available": False}
            continue
        best_overall = min(means, key=means.__getitem__)
        parallel = {k: v for k, v in means.items() if k == "iresflow" or k in PARALLEL_PEERS}
        best_parallel = min(parallel, key=parallel.__getitem__)
        per_dataset[name] = {
            "available": True, "best_overall": best_overall, "best_parallel": best_parallel,
            "iresflow_best_overall": best_overall == "iresflow",
            "iresflow_best_parallel": best_parallel == "iresflow",
            "parallel_params": {k: per_model[k]["summary"]["params"] for k in parallel},
        }
    available = [d for d in per_dataset.values() if d["available"]]
    wins = sum(d["iresflow_best_overall"] for d in available)
    parallel_wins = sum(d["iresflow_best_parallel"] for d in available)
    complete = len(available) == len(DATASETS)
    return {"datasets": per_dataset, "best_overall_count": wins,
            "best_parallel_count": parallel_wins, "complete": complete,
            "holds": complete and wins >= 2 and parallel_wins == len(DATASETS)}


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) and math.isfinite(value) else "—"


def _fmt_time(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _row(key: str, entry: dict[str, Any]) -> list[list[str]]:
    """The table row(s) of one model: its numbers, then its failed runs if any."""
    spec = SPECS[key]
    if entry["status"] != "ok":
        return [[spec.label, spec.sampler, f"n/a ({entry['reason']})", *[""] * 6]]
    s = entry["summary"]
    nll = "failed"
    if "test_nll" in s:
        std = s.get("test_nll_std")
        nll = _fmt(s["test_nll"]) + (f" ± {_fmt(std)}" if std is not None else "")
    if key == "cnf" and s.get("test_divergence") == "hutchinson":
        nll += " (Hutchinson est.)"
    if s.get("order") is not None:
        nll += f" (p = {s['order']})"
    roulette = "—"
    if "test_nll_roulette" in s:
        roulette = f"{_fmt(s['test_nll_roulette'])} ± {s['test_nll_roulette_stderr']:.1g}"
    lr = entry.get("best_lr")
    rows = [[spec.label, spec.sampler, nll, roulette, str(s.get("params", "—")),
             _fmt(s.get("seconds_per_epoch"), 2), _fmt(s.get("epochs"), 1),
             _fmt_time(s.get("sample_seconds_per_sequence")),
             "closed form" if lr is None else f"{lr:g}"]]
    if s.get("errors"):
        rows.append([f"↳ failed runs: {'; '.join(s['errors'])}", *[""] * 8])
    return rows


def markdown_tables(content: dict[str, Any]) -> str:
    """The tables and the target check of a file of the table (the ``results`` block)."""
    settings, machine = content["settings"], content["machine"]
    budget = settings["budget"]
    mode = "full"
    if settings["quick"]:
        mode = "quick mode: tiny budgets and data subsets, not a result"
    training = {
        "table": f"{budget['max_seconds']:g} s of optimisation per run, at most "
                 f"{budget['max_epochs']} epochs, early stopping",
        "convergence": f"trained to convergence: early stopping with patience "
                       f"{budget['patience']}, at most {budget['max_epochs']} epochs or "
                       f"{budget['max_seconds']:g} s",
        "budget": f"equal budgets of {budget['max_seconds']:g} s of optimisation per run, no "
                  "early stopping, best validation epoch kept",
    }[settings["mode"]]
    lines = [f"Test NLL, lower is better: mean ± std over {budget['seeds']} seed(s) ({mode}; "
             f"{training}; CPU, {machine['threads']} thread(s) per run)."]
    table = entries(content["records"])
    for record in sorted(content["records"], key=lambda r: DATASETS.index(r["dataset"])):
        sizes = record["sizes"]
        lines += ["", f"**{record['dataset']}** ({record['unit']}, N = {record['max_len']}, "
                      f"D = {record['features']}, {sizes['train']}/{sizes['val']}/{sizes['test']} "
                      f"train/val/test; baselines matched to ≈{record['target_params']} "
                      "parameters)", "",
                  markdown_table(["model", "sampler", "test NLL", "roulette estimate ± s.e.",
                                  "params", "s/epoch", "epochs", "sampling / seq", "lr"],
                                 [row for key, entry in table[record["dataset"]].items()
                                  for row in _row(key, entry)])]
    lines += ["", _target_text(target_check(table))]
    return "\n".join(lines)


def _target_text(target: dict[str, Any]) -> str:
    parts = ["**Target** (iresflow with its default recipe has the best test NLL on at least 2 "
             "of 3 datasets, and the best among the parallel samplers iresflow, RealNVP and CNF "
             "on all three): "]
    if not target["complete"]:
        parts.append("**not evaluated** — iresflow results are missing for some datasets. ")
    else:
        parts.append("**holds**. " if target["holds"] else "**does not hold**. ")
    parts.append(f"Best overall on {target['best_overall_count']}/{len(DATASETS)}, best among "
                 f"parallel samplers on {target['best_parallel_count']}/{len(DATASETS)}.")
    for name, d in target["datasets"].items():
        if not d["available"]:
            parts.append(f" {name}: no iresflow result.")
            continue
        params = ", ".join(f"{SPECS[k].label.split(' (')[0]} {v}"
                           for k, v in d["parallel_params"].items())
        parts.append(f" {name}: best overall {SPECS[d['best_overall']].label}; best parallel "
                     f"{SPECS[d['best_parallel']].label} (parameters: {params}).")
    return "".join(parts)


def provenance_text(entries: dict[str, dict[str, Any]]) -> str:
    """Which command (and trainer) produced which rows.

    Example:
        >>> entry = {"generated_by": "python -m benchmarks results", "trainer": TRAINER}
        >>> provenance_text({"co2_windows": {"iresflow": entry}})
        'Rows of iresflow generated by `python -m benchmarks results` (trained by `iresflow.train.fit.fit`).'
    """  # noqa: E501
    sources: dict[tuple[str, str], list[str]] = {}
    for per_model in entries.values():
        for key, entry in per_model.items():
            source = (entry["generated_by"], entry.get("trainer", EARLIER_TRAINER))
            models = sources.setdefault(source, [])
            if key not in models:
                models.append(key)
    return " ".join(
        f"Rows of {', '.join(sorted(models, key=list(SPECS).index))} generated by `{command}` "
        f"(trained by {trainer})." for (command, trainer), models in sources.items()
    )


def blocks(content: dict[str, Any]) -> dict[str, str]:
    """The Markdown blocks (:data:`BLOCKS`) of a file of the table."""
    budget, machine = content["settings"]["budget"], content["machine"]
    protocol = (
        "* Data: `iresflow.data.load_dataset(name, seed=0)`: the same splits, preprocessing and "
        "units (original units, including the preprocessing's log-Jacobian) for every model.\n"
        f"* Training: one trainer for every model, the loop of `iresflow train` ({TRAINER}, "
        "with the settings of `benchmarks.results_specs.train_config`): Adam at a constant "
        "learning rate, minibatches of 64 sequences, loss = NLL per unit of the dataset, "
        "gradient-norm clipping at 100, validation after every epoch, early stopping after "
        "`patience` epochs without a better validation NLL, best validation epoch restored; the "
        "same epoch and time budget per run. The iresflow rows are built from their settings as "
        "`iresflow train` builds them.\n"
        "* Tuning: learning rates "
        f"{', '.join(f'{lr:g}' for lr in budget['lrs'])} on the validation split with seed 0; "
        "the best one is then trained with the remaining seeds. Widths of MAF, RealNVP, CNF "
        "and GRU + MAF are chosen so that their parameter counts are closest to the default "
        "iresflow model (4 blocks, hidden 64) on each dataset. Validation (early stopping and "
        "the choice of learning rate) uses each model's cheap evaluation: the exact density for "
        "the Gaussians and nflows models, the validation of `iresflow train` for iresflow "
        "(Russian roulette, 4 estimates per sequence, and the inverse check), and a Hutchinson "
        "estimate with probes fixed across epochs for the CNF.\n"
        "* iresflow: test NLL with the exact log-determinant (dense Jacobians), next to the "
        f"Russian-roulette estimate ({budget['roulette_samples']} estimates per sequence; "
        "standard error over sequences and seeds).\n"
        "* CNF: FFJORD-style, dopri5 with `odeint_adjoint`, tolerance 1e-3 in training and 1e-5 "
        "in evaluation; Hutchinson divergence in training; at test time the exact divergence "
        f"(Jacobian trace) when N·D ≤ {budget['cnf_exact_max_dim']}, else a one-probe "
        "Hutchinson estimate (unbiased, marked in the table).\n"
        "* Gaussians: closed-form maximum likelihood on the training split with a ridge of 1e-4 "
        "on the covariance diagonal; the sequence Gaussian needs fixed-length data.\n"
        "* AR(p) Gaussian over frames (`iresflow.models.reference.AutoregressiveGaussian`): "
        "x_t | x_{t-1..t-p} ~ N(A [x_{t-1..t-p}] + b, S), frames t ≤ p with the AR(t-1) "
        "conditional fitted on the t-th frames; every conditional by least squares with the "
        "residual covariance (ridge 1e-4); p in 0.."
        f"{MAX_AR_ORDER} chosen by the validation NLL of fits on the training split, then "
        "refitted on training and validation sequences (so its `val_nll` in the JSON is "
        "in-sample; `order_val_nll` holds the validation NLLs, model space, that chose p).\n"
        "* GRU + MAF (`benchmarks/baselines/recurrent.py`): a GRU over the past frames whose "
        "state is the context of an nflows MAF (4 layers) over the next frame; width matched "
        "to the parameter target like MAF, RealNVP and CNF.\n"
        "* Learning curves (`figures/`): the test NLL of the current parameters, with the "
        "validation estimator, against optimisation seconds (geometric steps), mean over seeds "
        "(interpolated in log time); closed-form fits as horizontal lines.\n"
        "* Times: optimisation wall time per epoch (validation excluded) and sampling wall "
        f"time per sequence (batches of {budget['sample_num']}), on {machine['machine']}, "
        "with other processes possibly sharing the CPU: compare within a table, not across "
        f"machines. This run: {machine['wall_seconds'] / 60:.0f} min wall time with "
        f"{machine['jobs']} parallel run(s) of {machine['threads']} thread(s)."
    )
    return {"results": markdown_tables(content),
            "results-provenance": f"{provenance_text(entries(content['records']))} Do not edit "
                                  "the table by hand.",
            "results-protocol": protocol}
