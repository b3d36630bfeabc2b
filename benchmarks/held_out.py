"""Held-out datasets: public series that no default was chosen on, as long-format tables.

Six datasets that install offline with the benchmarks extra (``aeon`` and ``statsmodels`` ship
the files), written the way such data usually reach a user (one row per series and time step,
a CSV file) and read the way a user reads them: through ``iresflow train``'s table settings
(``--id-column``, ``--time-column``, ``--value-columns``, ``--window``, ``--stride``). They
cover what the small-data suite lacks:

* ``uschange``: quarterly US consumption, income, production, savings and unemployment
  changes 1970-2016 (aeon ``Uschange``), D = 5; windows of 12 quarters every 3, the first 80%
  of the quarters for training and the rest for testing (no window spans both).
* ``m1_yearly``: the 181 yearly series of the M1 competition (aeon ``m1_yearly_dataset``) as
  log growth rates: variable length 14-57, heavy tails.
* ``daphnet``: 9 accelerometer channels of a walking subject at 64 Hz (aeon
  ``Daphnet_S06R02E0``), windows of 200 frames: long, multivariate, 35 sequences.
* ``bleeding``: arterial blood pressure of a patient (aeon ``KDD-TSAD_135``, its normal
  training part and its test part with an anomaly), windows of 200 samples every 50:
  long, 21 training sequences.
* ``elnino``: monthly sea-surface temperature 1950-2010 (statsmodels ``elnino``), one year per
  sequence: N = 12, 61 sequences.
* ``fertility``: log fertility rate of 219 countries 1960-2013 (statsmodels ``fertility``),
  missing years as missing frames: variable length and gaps.

:func:`table_settings` writes the files of a dataset into a folder and returns the settings of
``iresflow train`` that read them; the small-data suite (:mod:`benchmarks.small_data`,
``--datasets uschange ...``) trains on them. To get the files and the command that trains on
each::

    python -m benchmarks held_out --out held_out_data
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HELD_OUT", "aeon_file", "read_tsf_series", "table_settings", "train_command"]

#: The held-out datasets, in the table's order.
HELD_OUT = ("uschange", "m1_yearly", "daphnet", "bleeding", "elnino", "fertility")
#: Fraction of the quarters of ``uschange`` that form its training file.
_USCHANGE_TRAIN = 0.8


def aeon_file(*parts: str) -> Path:
    """A data file shipped in aeon's wheel (``datasets/data/PARTS``), located without importing
    aeon (its import is slow).

    Raises:
        ImportError: aeon is not installed.
        FileNotFoundError: the installed aeon does not ship the file.
    """
    spec = importlib.util.find_spec("aeon")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the dataset ships with aeon: pip install iresflow[benchmarks]")
    path = Path(list(spec.submodule_search_locations)[0], "datasets", "data", *parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed aeon")
    return path


def read_tsf_series(path: Path) -> list[np.ndarray]:
    """The value arrays of a Monash ``.tsf`` file: its ``name:start:v1,v2,...`` rows after the
    ``@data`` line, each as a ``(length,)`` array."""
    series, in_data = [], False
    for line in path.read_text().splitlines():
        if in_data and line.strip():
            series.append(np.array(line.rsplit(":", 1)[1].split(","), dtype=float))
        in_data = in_data or line.strip().lower() == "@data"
    return series


def _uschange(folder: Path) -> dict[str, Any]:
    import pandas as pd

    frame = pd.read_csv(aeon_file("Uschange", "Uschange.csv"), index_col=0)
    cut = int(len(frame) * _USCHANGE_TRAIN)
    frame.iloc[:cut].to_csv(folder / "uschange_train.csv", index=False)
    frame.iloc[cut:].to_csv(folder / "uschange_test.csv", index=False)
    return {"data": str(folder / "uschange_train.csv"),
            "test_data": str(folder / "uschange_test.csv"),
            "value_columns": ["Consumption", "Income", "Production", "Savings", "Unemployment"],
            "window": 12, "stride": 3}


def _m1_yearly(folder: Path) -> dict[str, Any]:
    import pandas as pd

    rows = []
    for index, values in enumerate(read_tsf_series(aeon_file("m1_yearly_dataset",
                                                               "m1_yearly_dataset.tsf"))):
        growth = np.diff(np.log(values))
        rows.append(pd.DataFrame({"series": index, "year": np.arange(len(growth)),
                                  "growth": growth}))
    pd.concat(rows).to_csv(folder / "m1_yearly.csv", index=False)
    return {"data": str(folder / "m1_yearly.csv"), "id_column": "series", "time_column": "year"}


def _daphnet(folder: Path) -> dict[str, Any]:
    import pandas as pd

    frame = pd.read_csv(aeon_file("Daphnet_S06R02E0", "S06R02E0.csv"))
    frame.drop(columns=["timestamp", "is_anomaly"]).to_csv(folder / "daphnet.csv", index=False)
    return {"data": str(folder / "daphnet.csv"), "window": 200}


def _bleeding(folder: Path) -> dict[str, Any]:
    import pandas as pd

    paths = {}
    for part in ("TRAIN", "TEST"):
        frame = pd.read_csv(aeon_file("KDD-TSAD_135",
                                       f"135_UCR_Anomaly_InternalBleeding16_{part}.csv"))
        paths[part] = folder / f"bleeding_{part.lower()}.csv"
        frame[["timestamp", "value"]].to_csv(paths[part], index=False)
    return {"data": str(paths["TRAIN"]), "test_data": str(paths["TEST"]),
            "time_column": "timestamp", "window": 200, "stride": 50}


def _elnino(folder: Path) -> dict[str, Any]:
    import statsmodels.api as sm

    wide = sm.datasets.elnino.load_pandas().data
    long = wide.melt(id_vars="YEAR", var_name="month", value_name="temperature")
    long["month"] = long["month"].map({m: i for i, m in enumerate(wide.columns[1:])})
    long.sort_values(["YEAR", "month"]).to_csv(folder / "elnino.csv", index=False)
    return {"data": str(folder / "elnino.csv"), "id_column": "YEAR", "time_column": "month"}


def _fertility(folder: Path) -> dict[str, Any]:
    import statsmodels.api as sm

    wide = sm.datasets.fertility.load_pandas().data
    years = [c for c in wide.columns if c.isdigit()]
    long = wide.melt(id_vars="Country Code", value_vars=years, var_name="year",
                     value_name="rate").dropna()
    long["year"] = long["year"].astype(int)
    long["log_rate"] = np.log(long.pop("rate"))
    long.sort_values(["Country Code", "year"]).to_csv(folder / "fertility.csv", index=False)
    return {"data": str(folder / "fertility.csv"), "id_column": "Country Code",
            "time_column": "year"}


_WRITERS = {"uschange": _uschange, "m1_yearly": _m1_yearly, "daphnet": _daphnet,
            "bleeding": _bleeding, "elnino": _elnino, "fertility": _fertility}


def table_settings(name: str, folder: Path) -> dict[str, Any]:
    """Write the table files of a held-out dataset into ``folder``; the settings of
    ``iresflow train`` that read them (``data``, ``test_data`` and the table layout).

    Args:
        name: One of :data:`HELD_OUT`.
        folder: An existing folder; the dataset's files are (over)written there.

    Raises:
        ValueError: ``name`` is not in :data:`HELD_OUT`.
        ImportError: aeon, statsmodels or pandas is missing (the benchmarks extra).
    """
    if name not in _WRITERS:
        raise ValueError(f"name must be one of {HELD_OUT}, got {name!r}")
    settings = _WRITERS[name](folder)
    return {"data": settings["data"], "test_data": None, **settings}


def train_command(settings: dict[str, Any]) -> str:
    """The ``iresflow train`` command line of flat data settings (``None`` left out).

    Example:
        >>> train_command({"data": "a b.csv", "test_data": None, "value_columns": ["x", "y"],
        ...                "window": 12})
        "iresflow train --data 'a b.csv' --value-columns x,y --window 12"
    """
    words = ["iresflow", "train"]
    for key, value in settings.items():
        if value is not None:
            text = ",".join(value) if isinstance(value, list | tuple) else str(value)
            words += [f"--{key.replace('_', '-')}", text]
    return shlex.join(words)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True,
                        help="folder to write the table files into (created if missing)")
    parser.add_argument("--datasets", nargs="+", choices=HELD_OUT, default=list(HELD_OUT),
                        metavar="NAME", help=f"among {', '.join(HELD_OUT)} (default: all)")


def run(args: argparse.Namespace) -> int:
    """Write the datasets' files into ``--out``; print the command that trains on each."""
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.datasets:
        print(f"{name}: {train_command(table_settings(name, args.out))}")
    return 0
