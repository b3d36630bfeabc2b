"""Tests of iresflow.data.tables: long-format CSV and Parquet files and pandas DataFrames read
as padded sequences with missing frames, in load_dataset, TrainConfig and ``iresflow train``."""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_runs import TINY

from iresflow.cli import main, parse_train_config
from iresflow.data import TableLayout, load_dataset, read_table
from iresflow.data.tables import TABLE_SETTINGS
from iresflow.runs.load import load_run
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.fit import fit

LAYOUT = TableLayout(id_column="id", time_column="t")


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    """A CSV file of ``rows``; floats written with ``repr`` (the shortest exact decimal)."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows([[repr(c) if isinstance(c, float) else c for c in row] for row in rows])
    return path


def series_rows(n_series: int, length: int, seed: int = 0) -> list[list[Any]]:
    """Rows ``id, day, a, b`` of ``n_series`` daily series with random gaps."""
    generator = np.random.default_rng(seed)
    rows = []
    for s in range(n_series):
        for day in range(length):
            if day in (0, length - 1) or generator.random() > 0.15:
                a, b = generator.standard_normal(2) * 10.0 ** generator.integers(-3, 4, 2)
                rows.append([f"s{s}", f"2024-03-{day + 1:02d}", float(a), float(b)])
    return rows


# --- reading ---------------------------------------------------------------------------------


def test_values_are_float64_exact_and_gaps_are_missing_frames(tmp_path: Path) -> None:
    rows = series_rows(3, 20)
    x, mask = read_table(write_csv(tmp_path / "s.csv", ["id", "t", "a", "b"], rows), LAYOUT)
    assert x.dtype == torch.float64 and x.shape == (3, 20, 2)
    expected_mask = torch.zeros(3, 20, dtype=torch.bool)
    expected = torch.zeros(3, 20, 2, dtype=torch.float64)
    for name, day, a, b in rows:
        s, d = int(name[1:]), int(day[-2:]) - 1
        expected_mask[s, d] = True
        expected[s, d] = torch.tensor([a, b], dtype=torch.float64)
    assert torch.equal(mask, expected_mask) and not bool(mask.all())
    assert torch.equal(x, expected)  # bit for bit, zeros at the missing frames


def test_row_order_series_order_and_step_inference(tmp_path: Path) -> None:
    # rows out of order; series in order of first row; the most common difference is the step
    rows = [["b", 10, 1.0], ["a", 4, 2.0], ["b", 4, 3.0], ["a", 0, 4.0], ["b", 6, 5.0],
            ["a", 2, 6.0]]
    x, mask = read_table(write_csv(tmp_path / "s.csv", ["id", "t", "v"], rows), LAYOUT)
    assert x[..., 0].tolist() == [[3.0, 5.0, 0.0, 1.0], [4.0, 6.0, 2.0, 0.0]]
    assert mask.tolist() == [[True, True, False, True], [True, True, True, False]]
    # equally common differences 1 and 2: the smaller one
    rows = [["a", 0, 1.0], ["a", 1, 2.0], ["a", 3, 3.0]]
    _, mask = read_table(write_csv(tmp_path / "tie.csv", ["id", "t", "v"], rows), LAYOUT)
    assert mask.tolist() == [[True, True, False, True]]


def test_without_time_or_id_columns_rows_follow_each_other(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "s.csv", ["id", "v", "label"],
                     [["a", 1.0, "x"], ["b", 2.0, "y"], ["a", 3.0, "z"]])
    x, mask = read_table(path, TableLayout(id_column="id"))  # label: text, not a value column
    assert x[..., 0].tolist() == [[1.0, 3.0], [2.0, 0.0]] and mask.tolist() == [[1, 1], [1, 0]]
    x, mask = read_table(path, TableLayout(value_columns=("v",)))
    assert x.shape == (1, 3, 1) and x.flatten().tolist() == [1.0, 2.0, 3.0] and mask.all()


def test_a_frame_with_a_missing_value_is_missing(tmp_path: Path) -> None:
    rows = [[0, 1.0, 2.0], [1, "", 3.0], [2, 4.0, "NA"], [3, "nan", "null"], [4, 5.0, 6.0]]
    x, mask = read_table(write_csv(tmp_path / "s.csv", ["t", "a", "b"], rows),
                         TableLayout(time_column="t"))
    assert mask.tolist() == [[True, False, False, False, True]]
    assert x[0].tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [5.0, 6.0]]


@pytest.mark.parametrize(
    ("window", "stride", "starts"),
    [(4, None, [0, 4]), (4, 2, [0, 2, 4, 6]), (3, 4, [0, 4]), (10, None, [0]), (11, 3, [0])],
)
def test_windows_and_stride(tmp_path: Path, window: int, stride: int | None,
                            starts: list[int]) -> None:
    # one series of 10 frames (values 0..9) and one of 2 frames
    rows = [["a", t, float(t)] for t in range(10)] + [["b", 0, 20.0], ["b", 1, 21.0]]
    path = write_csv(tmp_path / "s.csv", ["id", "t", "v"], rows)
    x, mask = read_table(path, TableLayout(id_column="id", time_column="t", window=window,
                                           stride=stride))
    length = min(window, 10)
    expected = [list(range(s, s + length)) for s in starts]
    assert x.shape == (len(starts) + 1, length, 1)
    assert x[: len(starts), :, 0].tolist() == [[float(v) for v in w] for w in expected]
    # a series shorter than the window stays one shorter sequence
    assert x[-1, :2, 0].tolist() == [20.0, 21.0] and mask[-1].sum() == 2


def test_a_window_inside_a_gap_is_left_out(tmp_path: Path) -> None:
    rows = [[t, float(t)] for t in (0, 1, 2, 3, 8, 9, 10, 11)]  # step 1, frames 4..7 missing
    path = write_csv(tmp_path / "s.csv", ["t", "v"], rows)
    x, mask = read_table(path, TableLayout(time_column="t", window=4))
    assert x[:, 0, 0].tolist() == [0.0, 8.0] and mask.all()
    x, mask = read_table(path, TableLayout(time_column="t", window=4, stride=2))
    assert x[:, 0, 0].tolist() == [0.0, 2.0, 0.0, 8.0]  # the windows at 0, 2, 6, 8; not 4
    assert mask.int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize(
    ("times", "mask"),
    [
        (["2024-01-01", "2024-01-02", "2024-01-04"], [1, 1, 0, 1]),  # days
        (["2024-01-31", "2024-02-29", "2024-04-30"], [1, 1, 0, 1]),  # month ends
        (["2023-11-15", "2023-12-15", "2024-02-15"], [1, 1, 0, 1]),  # months
        (["1949-01", "1949-02", "1949-04"], [1, 1, 0, 1]),  # YYYY-MM
        (["2020-01-01", "2021-01-01", "2023-01-01"], [1, 1, 0, 1]),  # years
        (["2024-01-01T00:00Z", "2024-01-01T01:00Z", "2024-01-01T03:00:00+00:00"],
         [1, 1, 0, 1]),  # hours, in UTC
        (["2024-01-01T01:00+01:00", "2024-01-01T00:30:00Z", "2024-01-01T01:00Z"],
         [1, 1, 1]),  # half hours, time zones
        (["0.1", "0.2", "0.4", "0.5"], [1, 1, 0, 1, 1]),  # binary rounding of 0.1 steps
        (["-3", "-1", "5"], [1, 1, 0, 0, 1]),
    ],
)
def test_times_on_a_grid(tmp_path: Path, times: list[str], mask: list[int]) -> None:
    path = write_csv(tmp_path / "s.csv", ["t", "v"], [[t, 1.0] for t in times])
    _, observed = read_table(path, TableLayout(time_column="t"))
    assert observed.int().tolist() == [mask]


def csv_error(tmp_path: Path, header: list[str], rows: list[list[Any]],
              layout: TableLayout = LAYOUT) -> str:
    path = write_csv(tmp_path / "bad.csv", header, rows)
    with pytest.raises(ValueError) as info:
        read_table(path, layout)
    message = str(info.value)
    assert message.startswith(str(path.resolve()))
    return message


@pytest.mark.parametrize(
    ("header", "rows", "layout", "message"),
    [
        (["id", "t", "v"], [["a", 1, 1.0], ["a", 2, 1.0], ["a", 2, 3.0]], LAYOUT,
         "line 4: series 'a' has two rows at time '2' (also line 3)"),
        (["id", "t", "v"], [["a", 0, 1.0], ["a", 2, 1.0], ["a", 4, 1.0], ["a", 5, 1.0]], LAYOUT,
         "line 5: time '5' of series 'a' is not a whole number of steps of 2"),
        (["t", "v"], [["2024-01-01", 1.0], ["2024-01-03", 1.0], ["2024-01-05", 1.0],
                      ["2024-01-06T12:00", 1.0]], TableLayout(time_column="t"),
         "line 5: time '2024-01-06T12:00' of the series is not a whole number "
         "of steps of 2 days, 0:00:00"),
        (["id", "t", "v"], [["a", 1, 1.0], ["a", 2, "1,5"]], LAYOUT.replace(value_columns=("v",)),
         "line 3: column 'v': '1,5' is not a number"),
        (["id", "t", "v"], [["a", 1, 1.0], ["a", 2, "inf"]], LAYOUT,
         "line 3: column 'v': Inf values are not allowed"),
        (["id", "t", "v"], [["a", 1, 1.0]], TableLayout(id_column="station"),
         "no column 'station' (the columns: id, t, v)"),
        (["id", "t", "v"], [["a", 1, 1.0]], TableLayout(value_columns=("v", "w")),
         "no column 'w'"),
        (["id", "t", "v"], [], LAYOUT, "no rows (an empty table)"),
        (["id", "t", "v"], [["a", 1, 1.0], ["a", "", 2.0]], LAYOUT,
         "line 3: column 't': '' is not a time"),
        (["id", "t", "v"], [["a", 1, 1.0], ["a", "2024-01-02", 2.0]], LAYOUT,
         "line 3: column 't': '2024-01-02' is not a time"),
        (["id", "t", "v"], [["a", "noon", 1.0]], LAYOUT, "'noon' is not a time"),
        (["t", "v"], [["2024-01-01T00:00Z", 1.0], ["2024-01-01T01:00", 2.0]],
         TableLayout(time_column="t"), "line 3: column 't': times with and without a time zone"),
        (["id", "t", "v"], [["a", 1, 1.0], ["", 2, 2.0]], LAYOUT,
         "line 3: column 'id': missing series id"),
        (["id", "t", "v"], [["a", 1, 1.0], ["b", 1, ""]], LAYOUT,
         "series 'b' has no frame without a missing value"),
        (["id", "t", "v", "w"], [["a", 1, 1.0, 2.0], ["a", 2, 1.0, "x"]], LAYOUT,
         "line 3: column 'w' holds numbers and text ('x'); name the value columns"),
        (["id", "t", "name"], [["a", 1, "x"]], LAYOUT, "no column of numbers besides the id"),
        (["t", "v"], [[0, ""], [1, ""], [2, 1.0], [3, 1.0]],
         TableLayout(time_column="t", window=2, stride=3),
         "no window of 2 frames (stride 3) holds an observed frame"),
    ],
)
def test_bad_tables_name_the_file_the_line_and_the_column(
    tmp_path: Path, header: list[str], rows: list[list[Any]], layout: TableLayout, message: str
) -> None:
    assert message in csv_error(tmp_path, header, rows, layout)


def test_malformed_csv_files(tmp_path: Path) -> None:
    cases = {
        "empty.csv": ("", "empty file (no header line of column names)"),
        "cells.csv": ("t,v\n1,2\n3\n", "line 3: 1 cells, the header has 2"),
        "twice.csv": ("t,v,v\n1,2,3\n", "two columns are named 'v'"),
        "unnamed.csv": ("t,,v\n1,2,3\n", "column 2 has no name"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=re.escape(message)):
            read_table(tmp_path / name)
    (tmp_path / "latin.csv").write_bytes("t,v\n1,\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not a readable CSV file"):
        read_table(tmp_path / "latin.csv")
    with pytest.raises(FileNotFoundError):
        read_table(tmp_path / "none.csv")
    with pytest.raises(ValueError, match="a table file ends in .csv or .parquet"):
        read_table(tmp_path / "empty.txt")
    with pytest.raises(TypeError, match="layout must be a TableLayout"):
        read_table(tmp_path / "empty.csv", {"id_column": "id"})
    with pytest.raises(TypeError, match="source must be a path or a pandas DataFrame"):
        read_table([1, 2])


def test_a_blank_line_and_a_spreadsheet_bom_are_read(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_bytes("\ufeffid,t,v\r\na,1,1.5\r\n\r\na,2,2.5\r\n".encode())
    x, mask = read_table(path, LAYOUT)
    assert x.flatten().tolist() == [1.5, 2.5] and mask.all()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"stride": 2}, "stride = 2 needs a window"),
        ({"window": 0}, "window must be >= 1"),
        ({"window": 4, "stride": 0}, "stride must be >= 1"),
        ({"value_columns": ()}, "value_columns must name at least one column"),
        ({"id_column": "a", "value_columns": ("b", "a")}, "column 'a' is named twice"),
        ({"time_column": ""}, "a column name must not be empty"),
        ({"window": "4"}, "window must be of type int"),
    ],
)
def test_table_layout_checks(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TableLayout(**settings)


# --- Parquet and DataFrames ------------------------------------------------------------------


def test_parquet_without_pandas_or_pyarrow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.parquet"
    path.write_bytes(b"PAR1")
    # Imported before pyarrow is hidden: pandas imported while it is would register its Arrow
    # types once more when pyarrow comes back, and the later Parquet tests would fail.
    for name in ("pandas", "pyarrow"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(ImportError, match=r"needs pandas and pyarrow \(pip install "
                                          r"iresflow\[tables\]\)"):
        read_table(path)


def frame_of(rows: list[list[Any]]) -> Any:
    """The DataFrame of :func:`series_rows`' rows, with the days as datetimes."""
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame(rows, columns=["id", "t", "a", "b"])
    return frame.assign(t=pandas.to_datetime(frame["t"]))


def test_csv_parquet_and_data_frame_read_alike(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    rows = series_rows(4, 15, seed=1)
    frame = frame_of(rows)
    frame.to_parquet(tmp_path / "s.parquet")
    layout = LAYOUT.replace(window=6, stride=3)
    x, mask = read_table(write_csv(tmp_path / "s.csv", ["id", "t", "a", "b"], rows), layout)
    for source in (tmp_path / "s.parquet", frame, frame.set_index(["id", "t"])):
        other_x, other_mask = read_table(source, layout)
        assert torch.equal(other_x, x) and torch.equal(other_mask, mask)


def test_data_frame_columns_of_every_kind() -> None:
    pandas = pytest.importorskip("pandas")
    stamps = pandas.to_datetime(["2024-01-01 00:00", "2024-01-01 02:00", "2024-01-01 03:00"])
    frame = pandas.DataFrame({
        "t": stamps.tz_localize("Europe/Paris"),
        "count": pandas.array([1, None, 3], dtype="Int64"),  # nullable integers
        "level": [0.5, 1.5, 2.5],
        "flag": [True, False, True],  # not a number: not a value column
        "note": ["x", None, "z"],
    })
    x, mask = read_table(frame, TableLayout(time_column="t"))
    assert x.shape == (1, 4, 2) and mask.tolist() == [[True, False, False, True]]
    assert x[0, 3].tolist() == [3.0, 2.5]
    frame = pandas.DataFrame({"t": [0, 1, 2], "v": [1.0, float("inf"), 2.0]})
    with pytest.raises(ValueError, match="^DataFrame: row 1: column 'v': Inf values"):
        read_table(frame, TableLayout(time_column="t"))
    frame = pandas.DataFrame({"t": [0.0, 1.0, float("nan")], "v": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="^DataFrame: row 2: column 't': nan is not a time"):
        read_table(frame, TableLayout(time_column="t"))


# --- load_dataset, TrainConfig and the command line ------------------------------------------


def test_load_dataset_reads_table_files_and_frames(tmp_path: Path) -> None:
    rows = series_rows(12, 12)
    path = write_csv(tmp_path / "s.csv", ["id", "t", "a", "b"], rows)
    layout = LAYOUT.replace(window=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # few sequences
        dataset = load_dataset(str(path), table=layout)
        test = load_dataset(str(path), table=layout, test_path=path)
    assert dataset.name == "s.csv" and dataset.features == 2 and dataset.max_len == 4
    assert len(dataset.train) + len(dataset.val) + len(dataset.test) == 36
    assert len(test.test) == 36 and len(test.train) + len(test.val) == 36
    with pytest.raises(ValueError, match="table is only used by table data"):
        load_dataset("japanese_vowels", table=layout)
    with pytest.raises(ValueError, match=r"needs path= pointing to a \.csv or \.parquet file"):
        load_dataset("table")
    with pytest.raises(TypeError, match="table must be a TableLayout"):
        load_dataset(str(path), table={"window": 4})
    with pytest.raises(ValueError, match="no column 'id'"):
        load_dataset(str(write_csv(tmp_path / "v.csv", ["v"], [[1.0]])), table=layout)
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"v": [1.0, 2.0]})
    with pytest.raises(ValueError, match="a DataFrame is table data"):
        load_dataset("npz", path=frame)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from_frame = load_dataset("table", path=frame_of(rows), table=layout)
    assert from_frame.name == "DataFrame"
    assert torch.equal(from_frame.train.x, dataset.train.x)


def test_train_config_holds_the_table_settings() -> None:
    names = [f.name for f, _ in TrainConfig.settings()]
    start = names.index("test_data") + 1
    assert tuple(names[start : start + len(TABLE_SETTINGS)]) == TABLE_SETTINGS
    layout = dict(TableLayout.settings())
    for field, hint in TrainConfig.settings()[start : start + len(TABLE_SETTINGS)]:
        assert field is next(f for f in layout if f.name == field.name)  # one definition
        assert hint == layout[field]
    assert TrainConfig().table == TableLayout()
    config = parse_train_config(["--data", "s.csv", "--id-column", "id", "--value-columns",
                                 "a,b", "--window", "8"])
    assert config.table == TableLayout(id_column="id", value_columns=("a", "b"), window=8)
    assert TrainConfig.from_toml_string(config.to_toml()) == config
    assert 'value_columns = ["a", "b"]' in config.to_toml()
    with pytest.raises(ConfigError, match="window is a setting of table data"):
        TrainConfig(table=TableLayout(window=8))
    with pytest.raises(ConfigError, match="stride = 2 needs a window"):
        TrainConfig.from_dict({"data": "s.csv", "stride": 2})
    TrainConfig(data="s.parquet", test_data="t.csv")  # two tables
    with pytest.raises(ConfigError, match="test_data = 't.npz' is not a file of the kind of data"):
        TrainConfig(data="s.csv", test_data="t.npz")


def test_csv_parquet_and_data_frame_train_bit_identically(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    # b as whole counts: a feature on a grid, dequantised alike from every source
    rows = [[*row[:3], float(round(abs(row[3]) % 5))] for row in series_rows(16, 12, seed=2)]
    frame = frame_of(rows)
    frame.to_parquet(tmp_path / "s.parquet")
    write_csv(tmp_path / "s.csv", ["id", "t", "a", "b"], rows)
    config = TINY.replace(data=str(tmp_path / "s.csv"), epochs=2, max_train=None,
                          max_eval=None, table=TableLayout(id_column="id", time_column="t",
                                                           window=6, stride=3))
    runs = []
    for source in (tmp_path / "s.csv", tmp_path / "s.parquet", frame):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dataset = load_dataset("table", path=source, seed=config.seed, table=config.table)
            counts = dataset.to_raw(dataset.train.x.double(), dataset.train.mask)[..., 1]
            noise = (counts - counts.round())[dataset.train.mask]
            assert 0.1 < float(noise.abs().max()) <= 0.5 + 1e-5  # dequantised by one step
            result = fit(config, dataset)
        history = [{k: v for k, v in row.items() if "seconds" not in k}
                   for row in result.history]
        runs.append((result.model.state_dict(), history))
    state, history = runs[0]
    for other_state, other_history in runs[1:]:
        assert other_history == history
        assert state.keys() == other_state.keys()
        assert all(torch.equal(state[k], other_state[k]) for k in state)


@pytest.mark.filterwarnings("ignore:.*fewer than 30")
def test_train_evaluate_and_sample_a_table_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = ["station", "date", "temp", "rain"]
    write_csv(tmp_path / "train.csv", header, series_rows(10, 16, seed=3))
    write_csv(tmp_path / "test.csv", header, series_rows(3, 16, seed=4))
    out = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "train.csv"), "--test-data",
            str(tmp_path / "test.csv"), "--id-column", "station", "--time-column", "date",
            "--window", "8", "--stride", "4", "--out", str(out), "--epochs", "1",
            "--n-blocks", "1", "--hidden", "8", "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    config = TrainConfig.from_toml(out / "config.toml")
    assert config.table == TableLayout(id_column="station", time_column="date", window=8,
                                       stride=4)
    assert config.test_data == str((tmp_path / "test.csv").resolve())
    evaluation = json.loads((out / "evaluation.json").read_text())["test"]
    assert next(iter(evaluation.values()))["sequences"] == 9  # 3 windows of 3 series
    run = load_run(out)
    # 30 overlapping windows: the one that overlaps the validation block is left out
    assert (len(run.dataset.train) + len(run.dataset.val), run.dataset.features) == (29, 2)
    assert main(["evaluate", str(out), "--device", "cpu"]) == 0
    assert main(["sample", str(out), "--num", "2", "--out", str(tmp_path / "s.npz")]) == 0
    with np.load(tmp_path / "s.npz") as samples:
        assert samples["x"].shape == (2, 8, 2)
    capsys.readouterr()
    assert main(["train", "--data", str(tmp_path / "train.csv"), "--id-column", "id",
                 "--out", str(tmp_path / "r2")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("iresflow: error: cannot load dataset") and "no column 'id'" in err


def test_a_causal_table_run_forecasts_the_next_days_of_every_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = ["station", "date", "temp", "rain"]
    write_csv(tmp_path / "train.csv", header, series_rows(10, 16, seed=3))
    recent = write_csv(tmp_path / "recent.csv", header, series_rows(3, 12, seed=5))
    out = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "train.csv"), "--id-column", "station",
                 "--time-column", "date", "--window", "8", "--stride", "4", "--causal",
                 "--out", str(out), "--epochs", "1", "--n-blocks", "1", "--hidden", "8",
                 "--device", "cpu", "--quiet"]) == 0
    forecast = tmp_path / "next.npz"
    assert main(["forecast", str(out), "--data", str(recent), "--horizon", "3", "--num", "4",
                 "--out", str(forecast)]) == 0
    assert "after the end of 3 sequences" in capsys.readouterr().out
    with np.load(forecast) as saved:  # the whole series read, its last 8 - 3 days the past
        assert saved["samples"].shape == (4, 3, 3, 2) and saved["start"].tolist() == [5] * 3
        raw, mask = read_table(recent, TableLayout(id_column="station", time_column="date"))
        observed = np.where(mask[:, 7:, None].numpy(), raw[:, 7:].numpy(), 0.0)
        scale = np.abs(observed).max(axis=(0, 1))  # float32 in model space: relative to it
        assert (np.abs(saved["observed"] - observed) <= 1e-5 * scale).all()
