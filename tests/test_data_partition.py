"""Tests of iresflow.data.partition: split sizes, and blocks of overlapping table windows that
share no frame between training, validation and test."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from test_data_tables import write_csv
from tiny_runs import TINY, forget_setting

from iresflow.data import TableLayout, load_dataset
from iresflow.data.partition import blocked_split, split_sizes
from iresflow.data.splits import SequenceDataset, SequenceSplit
from iresflow.runs.load import load_run
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.loop import train


@pytest.mark.parametrize(("total", "val", "test", "gap"), [(40, 0.25, 0.1, 3), (12, 0.25, 0.0, 2),
                                                            (30, 0.1, 0.1, 0), (9, 0.2, 0.0, 5)])
def test_blocked_split_is_ordered_blocks_with_gaps(
    total: int, val: float, test: float, gap: int
) -> None:
    train_index, val_index, test_index = blocked_split(total, val, test, gap)
    _, n_val, n_test = split_sizes(total, val, test)
    assert len(val_index) == n_val and len(test_index) == n_test
    assert torch.equal(train_index, torch.arange(len(train_index)))
    assert int(val_index[0]) == len(train_index) + gap  # the gap before validation
    assert torch.equal(val_index, torch.arange(int(val_index[0]), int(val_index[0]) + n_val))
    if n_test:
        assert int(test_index[0]) == int(val_index[-1]) + 1 + gap
    assert int(torch.cat([val_index, test_index]).max()) == total - 1  # the blocks end the data
    assert len(train_index) == total - n_val - n_test - gap * (1 + (n_test > 0))


def test_blocked_split_refuses_bad_gaps_and_too_few_windows() -> None:
    with pytest.raises(ValueError, match="gap must be an int >= 0"):
        blocked_split(20, 0.25, 0.0, -1)
    with pytest.raises(ValueError, match="overlapping windows are too few.*larger stride"):
        blocked_split(8, 0.25, 0.1, 2)


def _day_series(tmp_path: Path, days: dict[str, int], name: str = "s.csv") -> Path:
    """Series whose value is a code of their own and the day, so a frame names itself."""
    rows = [[series, day, 1000.0 * k + day] for k, (series, length) in enumerate(days.items())
            for day in range(length)]
    return write_csv(tmp_path / name, ["id", "day", "v"], rows)


def _frames(dataset: SequenceDataset, split: SequenceSplit) -> set[int]:
    raw = dataset.to_raw(split.x, split.mask)[split.mask][:, 0]
    return {round(float(v)) for v in raw}


def _load(path: Path, layout: TableLayout, seed: int = 0, **kwargs: object) -> SequenceDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # few sequences
        return load_dataset(str(path), table=layout, seed=seed, **kwargs)


def test_overlapping_windows_share_no_frame_between_splits(tmp_path: Path) -> None:
    path = _day_series(tmp_path, {"a": 60, "b": 80})  # 28 + 38 windows of 6 days every 2
    layout = TableLayout(id_column="id", time_column="day", window=6, stride=2)
    assert layout.overlap == 2
    dataset = _load(path, layout)
    train, val, test = (_frames(dataset, s) for s in (dataset.train, dataset.val, dataset.test))
    assert not train & val and not train & test and not val & test
    assert len(dataset.train) + len(dataset.val) + len(dataset.test) == 66 - 2 * 2
    assert min(val) >= 1000 and min(test) > max(val)  # the last stretches of the last series
    assert _frames(dataset, _load(path, layout, seed=1).val) == val  # no seed in the blocks
    with_test = _load(path, layout, test_path=path)
    assert not _frames(with_test, with_test.train) & _frames(with_test, with_test.val)
    assert len(with_test.train) + len(with_test.val) == 66 - 2 and len(with_test.test) == 66


def test_windows_that_do_not_overlap_keep_the_random_split(tmp_path: Path) -> None:
    path = _day_series(tmp_path, {"a": 60, "b": 80})
    layout = TableLayout(id_column="id", time_column="day", window=6, stride=6)
    assert layout.overlap == 0 and TableLayout(window=6).overlap == 0
    first, second = _load(path, layout), _load(path, layout, seed=1)
    assert len(first.train) + len(first.val) + len(first.test) == 10 + 13
    assert _frames(first, first.val) != _frames(second, second.val)


def test_window_split_random_keeps_the_split_of_earlier_runs(tmp_path: Path) -> None:
    path = _day_series(tmp_path, {"a": 60, "b": 80})
    layout = TableLayout(id_column="id", time_column="day", window=6, stride=2,
                         window_split="random")
    first, second = _load(path, layout), _load(path, layout, seed=1)
    assert len(first.train) + len(first.val) + len(first.test) == 66  # none left out
    assert _frames(first, first.train) & _frames(first, first.val)  # what blocks prevent
    assert _frames(first, first.val) != _frames(second, second.val)
    with pytest.raises(ConfigError, match="window_split must be one of blocks, random"):
        TableLayout(window=6, stride=2, window_split="time")


def test_a_run_written_before_window_split_reloads_with_its_random_split(tmp_path: Path) -> None:
    rows = [[day, float(day)] for day in range(80)]
    data = write_csv(tmp_path / "s.csv", ["day", "v"], rows)
    config = TINY.replace(data=str(data), table=TableLayout(time_column="day", window=6,
                                                            stride=2, window_split="random"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        train(config, tmp_path / "run", progress=False)
        paths = forget_setting(tmp_path / "run", "window_split")
        saved = TrainConfig.from_toml(paths.config, stored=True)
        assert saved.table.window_split == "random" and TableLayout().window_split == "blocks"
        run = load_run(tmp_path / "run")
        random, blocks = (load_data(config.replace(table=config.table.replace(window_split=k)))
                          for k in ("random", "blocks"))
    assert torch.equal(run.dataset.val.x, random.val.x)
    assert not torch.equal(run.dataset.val.x, blocks.val.x)
    # a run on other data written before the setting loads too: it changes nothing there
    vowels = TrainConfig.from_dict({"data": "japanese_vowels"}, stored=True)
    assert vowels.table.given() == [] and vowels.table.window_split == "random"
    with pytest.raises(ConfigError, match="window is a setting of table data"):
        TrainConfig(table=TableLayout(window=6, window_split="random"))
