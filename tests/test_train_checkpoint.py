"""Checkpoints: atomic writes, plain-data round trips, refusal of unsafe or broken files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from iresflow.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


class _Payload:
    """Pickles as a call of ``os.mkdir(marker)``: opening it must never run that call."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_checkpoint_round_trip_keeps_plain_data(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    state = {
        "epoch": 2, "best": float("inf"), "name": "x", "missing": None, "list": [1, 2.5],
        "rng": generator.get_state(), "weights": {"w": torch.randn(3, 2, dtype=torch.float64)},
    }
    save_checkpoint(state, tmp_path / "c.pt")
    loaded = load_checkpoint(tmp_path / "c.pt")
    assert loaded.keys() == state.keys()
    assert torch.equal(loaded["weights"]["w"], state["weights"]["w"])
    assert torch.equal(loaded["rng"], state["rng"])
    assert loaded["best"] == float("inf") and loaded["missing"] is None


def test_failed_write_leaves_previous_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)

    def broken_save(obj: object, file: object) -> None:
        file.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*: disk full"):
        save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


def test_malicious_checkpoint_is_refused_without_running_code(tmp_path: Path) -> None:
    # The payload is live: plain unpickling runs it.
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Payload(live)))
    assert live.is_dir()

    marker = tmp_path / "marker"
    torch.save({"model": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refusing checkpoint .*mkdir"):
        load_checkpoint(tmp_path / "evil.pt")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="not a torch archive"):
        load_checkpoint(tmp_path / "evil.pkl")
    assert not marker.exists()


def test_corrupt_or_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    save_checkpoint({"epoch": 1, "w": torch.ones(100)}, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "truncated.pt")
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="expected a dict"):
        load_checkpoint(tmp_path / "list.pt")
