"""The pages of the results table (:mod:`benchmarks.results`): Markdown tables, the target
check, which command produced which rows, stored reports merged with new rows, learning curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.results_specs import (
    DATASETS,
    END,
    MAX_AR_ORDER,
    MODES,
    PARALLEL_PEERS,
    SPECS,
    START,
    Budget,
    dataset,
    target_params,
    variable_length,
)

#: The first line of the command's help.
RESULTS_DESCRIPTION = ("The results table: iresflow against Gaussians, AR models, nflows flows "
                       "and a torchdiffeq CNF.")


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


# ------------------------------------------------------------------------------------------------
# the target of the issue and the tables


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
        params = {k: per_model[k]["summary"]["params"] for k in parallel}
        per_dataset[name] = {
            "available": True,
            "best_overall": best_overall,
            "best_parallel": best_parallel,
            "iresflow_best_overall": best_overall == "iresflow",
            "iresflow_best_parallel": best_parallel == "iresflow",
            "parallel_params": params,
        }
    available = [d for d in per_dataset.values() if d["available"]]
    wins = sum(d["iresflow_best_overall"] for d in available)
    parallel_wins = sum(d["iresflow_best_parallel"] for d in available)
    complete = len(available) == len(DATASETS)
    return {
        "datasets": per_dataset,
        "best_overall_count": wins,
        "best_parallel_count": parallel_wins,
        "holds": complete and wins >= 2 and parallel_wins == len(DATASETS),
        "complete": complete,
    }


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) and math.isfinite(value) else "—"


def _fmt_time(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _nll_cell(summary: dict[str, Any]) -> str:
    if "test_nll" not in summary:
        return "failed"
    std = summary.get("test_nll_std")
    return _fmt(summary["test_nll"]) + (f" ± {_fmt(std)}" if std is not None else "")


def markdown_tables(report: dict[str, Any]) -> str:
    """The tables and the target check, as Markdown (the text between the markers)."""
    lines: list[str] = []
    meta = report["meta"]
    mode = "quick mode: tiny budgets and data subsets, not a result" if meta["quick"] else "full"
    training = {
        "table": f"{meta['budget']['max_seconds']:g} s of optimisation per run, at most "
                 f"{meta['budget']['max_epochs']} epochs, early stopping",
        "convergence": f"trained to convergence: early stopping with patience "
                       f"{meta['budget']['patience']}, at most {meta['budget']['max_epochs']} "
                       f"epochs or {meta['budget']['max_seconds']:g} s",
        "budget": f"equal budgets of {meta['budget']['max_seconds']:g} s of optimisation per "
                  "run, no early stopping, best validation epoch kept",
    }[meta.get("mode", "table")]
    lines.append(
        f"Test NLL, lower is better: mean ± std over {meta['budget']['seeds']} seed(s) "
        f"({mode}; {training}; CPU, {meta['threads']} thread(s) per run)."
    )
    for name, per_model in report["datasets"].items():
        info = report["dataset_info"][name]
        lines += ["", f"**{name}** ({info['unit']}, N = {info['max_len']}, D = {info['features']}, "
                      f"{info['sizes']['train']}/{info['sizes']['val']}/{info['sizes']['test']} "
                      f"train/val/test; baselines matched to ≈{info['target_params']} parameters)",
                  "",
                  "| model | sampler | test NLL | roulette estimate ± s.e. | params | "
                  "s/epoch | epochs | sampling / seq | lr |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, entry in per_model.items():
            spec = SPECS[key]
            if entry["status"] != "ok":
                lines.append(f"| {spec.label} | {spec.sampler} | n/a ({entry['reason']}) "
                             "| | | | | | |")
                continue
            s = entry["summary"]
            nll = _nll_cell(s)
            if key == "cnf" and s.get("test_divergence") == "hutchinson":
                nll += " (Hutchinson est.)"
            if s.get("order") is not None:
                nll += f" (p = {s['order']})"
            roulette = "—"
            if "test_nll_roulette" in s:
                roulette = f"{_fmt(s['test_nll_roulette'])} ± {s['test_nll_roulette_stderr']:.1g}"
            lr = entry.get("best_lr")
            lines.append(
                f"| {spec.label} | {spec.sampler} | {nll} | {roulette} | "
                f"{s.get('params', '—')} | {_fmt(s.get('seconds_per_epoch'), 2)} | "
                f"{_fmt(s.get('epochs'), 1)} | {_fmt_time(s.get('sample_seconds_per_sequence'))} | "
                f"{'closed form' if lr is None else f'{lr:g}'} |"
            )
            if s.get("errors"):
                lines.append(f"| ↳ failed runs: {'; '.join(s['errors'])} | | | | | | | | |")
    lines += ["", _target_text(report["target"])]
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


def replace_between_markers(text: str, block: str, source: str, start: str = START,
                            end: str = END) -> str:
    """Replace what lies between the markers ``start`` and ``end`` of ``text`` by ``block``.

    Raises:
        ValueError: ``text`` (read from ``source``) does not contain each marker once, in order.

    Example:
        >>> replace_between_markers("a <!-- x --> old <!-- /x --> b", "new", "page",
        ...                         "<!-- x -->", "<!-- /x -->")
        'a <!-- x -->\nnew\n<!-- /x --> b'
    """
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{source} must contain the markers {start} and {end}, once each, "
                         "in this order")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{block}\n{end}{tail}"


def results_markdown(report: dict[str, Any]) -> str:
    """The whole ``results.md`` page."""
    budget = report["meta"]["budget"]
    return (
        "# Results\n\n"
        f"{provenance_text(report['datasets'])} Do not edit the table by hand.\n\n"
        f"{START}\n{markdown_tables(report)}\n{END}\n\n"
        "## Protocol\n\n"
        "* Data: `iresflow.data.load_dataset(name, seed=0)`: the same splits, preprocessing and "
        "units (original units, including the preprocessing's log-Jacobian) for every model.\n"
        f"* Training: one trainer for every model, the loop of `iresflow train` ({TRAINER}, "
        "with the settings of `benchmarks.results.train_config`): Adam at a constant learning "
        "rate, minibatches of 64 sequences, loss = NLL per unit of the dataset, gradient-norm "
        "clipping at 100, validation after every epoch, early stopping after `patience` epochs "
        "without a better validation NLL, best validation epoch restored; the same epoch and "
        "time budget per run. The iresflow rows are built from their settings as `iresflow "
        "train` builds them.\n"
        "* Tuning: learning rates "
        f"{', '.join(f'{lr:g}' for lr in budget['lrs'])} on the validation split with seed 0; "
        "the best one is then trained with the remaining seeds. Widths of MAF, RealNVP, CNF "
        "and GRU + MAF "
        "are chosen so that their parameter counts are closest to the default iresflow model "
        "(4 blocks, hidden 64) on each dataset. Validation (early stopping and the choice of "
        "learning rate) uses each model's cheap evaluation: the exact density for the Gaussians "
        "and nflows models, the validation of `iresflow train` for iresflow (Russian roulette, "
        "4 estimates per sequence, and the inverse check), and a Hutchinson estimate with "
        "probes fixed across epochs for the CNF.\n"
        "* iresflow: test NLL with the exact log-determinant (dense Jacobians), next to the "
        f"Russian-roulette estimate ({budget['roulette_samples']} estimates per sequence; "
        "standard error over sequences and seeds).\n"
        "* CNF: FFJORD-style, dopri5 with `odeint_adjoint`, tolerance 1e-3 in training and 1e-5 "
        "in evaluation; Hutchinson divergence in training; at test time the exact divergence "
        f"(Jacobian trace) when N·D ≤ {budget['cnf_exact_max_dim']}, else a one-probe "
        "Hutchinson estimate (unbiased, marked in the table).\n"
        "* Gaussians: closed-form maximum likelihood on the training split with a ridge of 1e-4 "
        "on the covariance diagonal; the sequence Gaussian needs fixed-length data.\n"
        "* AR(p) Gaussian over frames (`benchmarks/baselines/autoregressive.py`): "
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
        f"time per sequence (batches of {budget['sample_num']}), on "
        f"{report['meta']['machine']}, with other processes possibly sharing the CPU: "
        "compare within a table, not across machines. This run: "
        f"{report['meta']['wall_seconds'] / 60:.0f} min wall time with "
        f"{report['meta']['jobs']} parallel run(s) of {report['meta']['threads']} thread(s).\n"
    )


#: The trainer of the rows this version of the script trains.
TRAINER = "`iresflow.train.fit.fit`"
#: The trainer of rows stored before the benchmarks trained through ``iresflow train``'s loop.
EARLIER_TRAINER = "`fit_model` of the former `benchmarks/baselines/training.py`"


def provenance_text(entries: dict[str, dict[str, Any]]) -> str:
    """Which command (and trainer) produced which rows of a report.

    Example:
        >>> entry = {"generated_by": "python -m benchmarks.results", "trainer": TRAINER}
        >>> provenance_text({"co2_windows": {"iresflow": entry}})
        'Rows of iresflow generated by `python -m benchmarks.results` (trained by `iresflow.train.fit.fit`).'
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


def merge_report(stored: dict[str, Any], fresh: dict[str, dict[str, Any]], budget: Budget
                 ) -> dict[str, dict[str, Any]]:
    """The stored rows of a report with the ``fresh`` ones put in their place.

    Args:
        stored: A report written by :func:`main` (``results.json``); rows without their
            ``generated_by`` command take the report's.
        fresh: ``{dataset: {model: entry}}`` of the runs just made.
        budget: Their budget, which must be the stored one.

    Returns:
        The merged ``{dataset: {model: entry}}``, rows in the order of :data:`MODELS`.

    Raises:
        ValueError: the stored report has another budget.
    """
    if stored["meta"]["budget"] != json.loads(json.dumps(dataclasses.asdict(budget))):
        raise ValueError(f"the stored report has the budget {stored['meta']['budget']}, not "
                         f"{dataclasses.asdict(budget)}: run every model, without --merge")
    merged: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys([*stored["datasets"], *fresh]):
        rows = {key: {"generated_by": stored["meta"]["command"], **entry}
                for key, entry in stored["datasets"].get(name, {}).items()}
        rows.update(fresh.get(name, {}))
        merged[name] = {key: rows[key] for key in SPECS if key in rows}
    return merged


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def parser_of_main() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=RESULTS_DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="CI-sized run (< 2 min)")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--seeds", type=int, help="seeds per model (default 3; quick 1)")
    parser.add_argument("--mode", choices=MODES, default="table",
                        help="table: fixed budget with early stopping; convergence: early "
                        "stopping with a generous cap; budget: equal wall-clock budgets")
    parser.add_argument("--budget", type=float, help="optimisation seconds per run "
                        "(default 30; quick 1; required with --mode budget; with --mode "
                        "convergence a cap on top of early stopping, default 7200)")
    parser.add_argument("--max-epochs", type=int, help="override the epoch cap")
    parser.add_argument("--patience", type=int, help="override the early-stopping patience")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", type=Path, help="folder for results.md/json "
                        "(default docs/; quick benchmarks/out/quick/)")
    parser.add_argument("--readme", type=Path, help="also replace the table in this README")
    parser.add_argument("--merge", action="store_true", help="re-run only --models: keep the "
                        "other rows stored in the report of this mode (OUT/STEM.json)")
    return parser


def build_report(args: argparse.Namespace, budget: Budget, command: str,
                 entries: dict[str, dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The report written to ``results.json``: settings, dataset facts, rows and the target."""
    report: dict[str, Any] = {
        "meta": {
            "quick": args.quick,
            "mode": args.mode,
            "command": command,
            "budget": dataclasses.asdict(budget),
            "threads": args.threads,
            "jobs": args.jobs,
            "torch": torch.__version__,
            "machine": f"{platform.machine()} CPU with {os.cpu_count()} cores",
            "wall_seconds": seconds,
        },
        "dataset_info": {
            name: {
                "unit": ds.unit, "features": ds.features, "max_len": ds.max_len,
                "variable_length": variable_length(ds), "target_params": target_params(name),
                "sizes": {"train": len(ds.train), "val": len(ds.val), "test": len(ds.test)},
            }
            for name in entries
            for ds in (dataset(name, budget.subset),)
        },
        "datasets": entries,
    }
    report["target"] = target_check(entries)
    return report
