"""Fault tolerance: killed runs resume to the same result; failed writes keep the checkpoint."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from iresflow.cli import main
from iresflow.train.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "--max-train", "16", "--max-eval", "8", "--n-blocks", "1", "--hidden", "8", "--epochs", "4",
    "--batch-size", "8", "--device", "cpu", "--eval-method", "exact", "--quiet",
]


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "iresflow", "train", "--out", str(out), *extra]


def _curve(run: Path) -> list[dict[str, float]]:
    """The metrics of every epoch from the last checkpoint, without wall-clock times."""
    history = load_checkpoint(run / "checkpoints" / "last.pt")["history"]
    return [{k: v for k, v in row.items() if k != "train_seconds"} for row in history]


def _kill_after_first_checkpoint(out: Path, delay: float) -> None:
    """Start (or resume) the run, SIGKILL it ``delay`` seconds after a checkpoint exists."""
    resume = (out / "checkpoints" / "last.pt").is_file()
    command = _command(out, "--resume", "--quiet") if resume else _command(out, *SETTINGS)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        start = time.monotonic()
        while not (out / "checkpoints" / "last.pt").is_file() and process.poll() is None:
            assert time.monotonic() - start < 120, "no checkpoint appeared"
            time.sleep(0.02)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)


def _killed_and_resumed(tmp_path: Path, kills: int) -> None:
    reference = tmp_path / "reference"
    subprocess.run(_command(reference, *SETTINGS), cwd=ROOT, check=True, timeout=300,
                   capture_output=True)
    out = tmp_path / "killed"
    delays = torch.rand(kills, generator=torch.Generator().manual_seed(kills)) * 1.5
    for delay in delays.tolist():
        _kill_after_first_checkpoint(out, delay)
        for name in ("last.pt", "best.pt"):  # whatever exists after a kill loads cleanly
            if (out / "checkpoints" / name).is_file():
                load_checkpoint(out / "checkpoints" / name)
    finished = subprocess.run(_command(out, "--resume", "--quiet"), cwd=ROOT, timeout=300,
                              capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert "trained 4 epochs" in finished.stdout
    assert _curve(out) == _curve(reference)
    for name in ("last.pt", "best.pt"):
        a = load_checkpoint(out / "checkpoints" / name)
        b = load_checkpoint(reference / "checkpoints" / name)
        assert a["epoch"] == b["epoch"]
        for key, value in b["model"].items():
            assert torch.equal(a["model"][key], value), key
    assert not list((out / "checkpoints").glob(".*.tmp"))
    evaluation = json.loads((out / "evaluation.json").read_text())
    expected = json.loads((reference / "evaluation.json").read_text())
    assert evaluation["test"]["exact"]["nll"] == expected["test"]["exact"]["nll"]


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    _killed_and_resumed(tmp_path, kills=1)


@pytest.mark.slow
def test_a_run_killed_twice_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    _killed_and_resumed(tmp_path, kills=2)


def test_a_full_disk_is_one_error_line_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    tiny = [s if s != "4" else "1" for s in SETTINGS]  # one epoch
    assert main(["train", "--out", str(out), *tiny]) == 0
    last = out / "checkpoints" / "last.pt"
    before = last.read_bytes()
    capsys.readouterr()

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full_disk)
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"iresflow: error: cannot write checkpoint {last}: No space left")
    monkeypatch.undo()
    assert last.read_bytes() == before
    assert load_checkpoint(last)["epoch"] == 1
    assert not list((out / "checkpoints").glob(".*.tmp"))
