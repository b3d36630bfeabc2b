"""Beyond one process: torchrun launches (one and two nodes on the loopback), kills and resumes,
rank-sharded evaluation, and the resume of a run killed before its first checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.cli import main
from iresflow.data.datasets import SequenceSplit
from iresflow.models.config import ModelConfig
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.train.checkpoint import CheckpointError, load_checkpoint
from iresflow.train.config import TrainConfig
from iresflow.train.distributed import Launch, backend_for, torchrun_launch
from iresflow.train.likelihood import sharded_log_prob, split_log_prob
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from tests.oracles import assert_close_runs

ROOT = Path(__file__).resolve().parents[1]
# 13 sequences in batches of 6: the last global batch has one sequence, so rank 1 sits it out.
# The attention recipe: its float32 training path is the one the 1e-5 comparisons were set for
# (the default recipe's distributed equality is checked by tests/test_distributed.py).
SETTINGS = [
    "--max-train", "13", "--max-eval", "6", "--n-blocks", "1", "--hidden", "8",
    "--layers", "attention,mlp", "--ar-order", "0",
    "--batch-size", "6", "--device", "cpu", "--logdet", "exact", "--eval-method", "exact",
    "--scheduler", "plateau", "--min-steps", "1", "--quiet",
]  # one pass of 3 steps per epoch: few steps, so float32 reduction orders stay within 1e-5
RENDEZVOUS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _environment(**extra: str) -> dict[str, str]:
    """This environment without a torchrun rendezvous, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _iresflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "iresflow", *args]


def _torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "iresflow"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- the launch ------------------------------------------------------------------------------
def test_torchrun_environment_is_read_and_checked() -> None:
    assert torchrun_launch({}) is None
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           **RENDEZVOUS}
    assert torchrun_launch(env) == Launch(3, 4, 1, 2)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set"):
        torchrun_launch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK must be an integer"):
        torchrun_launch({**env, "RANK": "one"})
    with pytest.raises(ValueError, match=r"rank must lie in \[0, 4\)"):
        torchrun_launch({**env, "RANK": "4"})
    with pytest.raises(ValueError, match=r"local_rank must lie in \[0, 2\)"):
        Launch(0, 4, 2, 2)
    assert (backend_for("cpu"), backend_for("cuda")) == ("gloo", "nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_pins_each_rank_to_its_gpu(tmp_path: Path) -> None:
    command = _torchrun("--standalone", "--nproc-per-node", "2") + [
        "train", "--out", str(tmp_path / "run"), *SETTINGS, "--epochs", "1", "--device", "cuda",
    ]
    subprocess.run(command, cwd=ROOT, env=_environment(), check=True, timeout=600,
                   capture_output=True)
    assert load_checkpoint(RunPaths(tmp_path / "run").last)["nproc"] == 2


# -- resume before the first checkpoint -------------------------------------------------------
def test_a_run_killed_before_its_first_checkpoint_resumes_from_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TrainConfig(model=ModelConfig(n_blocks=1, hidden=8), max_train=8, max_eval=4,
                         batch_size=4, epochs=1, device="cpu", eval_method="exact",
                         scheduler="plateau", seed=2)
    reference = train(config, tmp_path / "reference", progress=False)
    out = tmp_path / "killed"
    out.mkdir()
    config.save(RunPaths(out).config)  # all a kill during the data loading leaves
    assert main(["train", "--out", str(out), "--resume", "--quiet"]) == 0
    assert "trained 1 epochs" in capsys.readouterr().out
    state = load_checkpoint(RunPaths(out).last)
    assert state["epoch"] == 1
    assert state["history"][0]["val_nll"] == reference.history[0]["val_nll"]
    with pytest.raises(CheckpointError, match="checkpoint not found"):  # no config either
        train(config, tmp_path / "empty", resume=True, progress=False)


# -- sharded evaluation -----------------------------------------------------------------------
def test_sharded_log_prob_is_split_log_prob_in_one_process() -> None:
    model = ResidualSequenceFlow(features=2, max_len=5, n_blocks=1, hidden=4)
    generator = torch.Generator().manual_seed(0)
    mask = torch.arange(5) < torch.randint(1, 6, (7, 1), generator=generator)
    x = torch.where(mask.unsqueeze(-1), torch.randn(7, 5, 2, generator=generator), 0.0)
    split = SequenceSplit(x, mask, torch.zeros(7, dtype=torch.float64))
    exact, _ = split_log_prob(model, split, method="exact", batch_size=3)
    sharded, stderr = sharded_log_prob(model, split, method="exact", batch_size=3)
    assert stderr is None
    torch.testing.assert_close(sharded, exact, rtol=1e-6, atol=1e-6)
    first = sharded_log_prob(model, split, method="roulette", n_samples=3, batch_size=3, seed=5)
    state = torch.get_rng_state()
    again = sharded_log_prob(model, split, method="roulette", n_samples=3, batch_size=3, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state is kept
    assert torch.equal(first[0], again[0]) and first[1] is not None and first[1].shape == (7,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sharded_log_prob_on_cuda_matches_the_cpu() -> None:
    model = ResidualSequenceFlow(features=2, max_len=4, n_blocks=1, hidden=4)
    split = SequenceSplit(torch.randn(5, 4, 2, generator=torch.Generator().manual_seed(1)),
                          torch.ones(5, 4, dtype=torch.bool), torch.zeros(5, dtype=torch.float64))
    on_cpu, _ = sharded_log_prob(model, split, method="exact", batch_size=2)
    on_gpu, _ = sharded_log_prob(model.to("cuda"), split, method="exact", batch_size=2)
    assert on_gpu.device.type == "cpu"
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_evaluation_on_two_processes_equals_one(tmp_path: Path) -> None:
    # Per-batch seeds: the roulette scores of 2 processes are those of 1, not just close.
    run = tmp_path / "run"
    config = TrainConfig(model=ModelConfig(n_blocks=1, hidden=8), max_train=8, max_eval=11,
                         batch_size=3, epochs=1, device="cpu", eval_method="exact",
                         scheduler="plateau")
    train(config, run, progress=False)
    loaded = load_run(run)
    launchers = {  # --nproc for one method, torchrun for the other
        "roulette": _iresflow("evaluate", "--nproc", "2"),
        "exact": _torchrun("--standalone", "--nproc-per-node", "2") + ["evaluate"],
    }
    for method, launcher in launchers.items():
        single = evaluate_run(loaded, method=method, n_samples=2, seed=4, save=False,
                              scores=tmp_path / f"{method}-1.npz")
        subprocess.run(
            launcher + [str(run), "--method", method, "--n-samples", "2", "--seed", "4",
                        "--scores", str(tmp_path / f"{method}-2.npz")],
            cwd=ROOT, env=_environment(), check=True, timeout=300, capture_output=True,
        )
        one, two = np.load(tmp_path / f"{method}-1.npz"), np.load(tmp_path / f"{method}-2.npz")
        assert one["log_prob"].shape == (11,) and sorted(one.files) == sorted(two.files)
        np.testing.assert_allclose(two["log_prob"], one["log_prob"], rtol=1e-6)
        nll = -one["log_prob"].sum() / float(loaded.dataset.test.frames.sum())
        assert nll == pytest.approx(single["nll"], rel=1e-9)
        # the closed-form reference, fitted on every rank, is the single process's
        saved = json.loads((run / "evaluation.json").read_text())["test"][method]
        assert saved["reference"] == single["reference"] and "nll" in single["reference"]


# -- torchrun ---------------------------------------------------------------------------------
def _rank_pid(tag: str, rank: int, timeout: float = 60.0) -> int:
    """The process of ``rank`` among those started with ``IRESFLOW_TEST_TAG=tag``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        for entry in Path("/proc").iterdir():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if f"IRESFLOW_TEST_TAG={tag}".encode() in environ and f"RANK={rank}".encode() in \
                    environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no process of rank {rank} appeared")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="needs Linux /proc")
def test_torchrun_two_processes_equal_one_through_a_kill_and_resume(tmp_path: Path) -> None:
    epochs = ["--epochs", "6"]
    reference = tmp_path / "reference"
    subprocess.run(_iresflow("train", "--out", str(reference), *SETTINGS, *epochs), cwd=ROOT,
                   env=_environment(), check=True, timeout=300, capture_output=True)
    out, tag = tmp_path / "torchrun", uuid.uuid4().hex
    launch = _torchrun("--standalone", "--nproc-per-node", "2")
    process = subprocess.Popen(
        launch + ["train", "--out", str(out), *SETTINGS, *epochs], cwd=ROOT,
        env=_environment(IRESFLOW_TEST_TAG=tag), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        victim = _rank_pid(tag, 1)
        start = time.monotonic()
        while not RunPaths(out).last.is_file() and process.poll() is None:
            assert time.monotonic() - start < 120, "no checkpoint appeared"
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        assert process.wait(timeout=120) != 0  # torchrun stops the other rank and fails
    finally:
        process.kill()
        process.wait()
    assert load_checkpoint(RunPaths(out).last)["epoch"] < 6  # the kill cut the run short
    finished = subprocess.run(launch + ["train", "--out", str(out), "--resume", "--quiet"],
                              cwd=ROOT, env=_environment(), timeout=300, capture_output=True,
                              text=True)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.count("trained 6 epochs") == 1  # only rank 0 prints
    state = load_checkpoint(RunPaths(out).last)
    assert state["nproc"] == 2 and len(state["rng_ranks"]) == 2
    assert_close_runs(reference, out, 1e-5)
    # The test NLL at the end: shared by the two ranks, gathered, written by rank 0.
    single, shared = (
        json.loads((run / "evaluation.json").read_text())["test"]["exact"]["nll"]
        for run in (reference, out)
    )
    assert shared == pytest.approx(single, rel=1e-5)


@pytest.mark.slow
def test_two_simulated_nodes_train_and_resume(tmp_path: Path) -> None:
    reference, out = tmp_path / "reference", tmp_path / "nodes"
    subprocess.run(_iresflow("train", "--out", str(reference), *SETTINGS, "--epochs", "2"),
                   cwd=ROOT, env=_environment(), check=True, timeout=300, capture_output=True)

    def both_nodes(*args: str) -> None:
        port = str(_free_port())
        nodes = [
            subprocess.Popen(
                _torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                          "--master-addr", "127.0.0.1", "--master-port", port)
                + ["train", "--out", str(out), *args],
                cwd=ROOT, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        outputs = [node.communicate(timeout=300) for node in nodes]
        for node, (_, stderr) in zip(nodes, outputs, strict=True):
            assert node.returncode == 0, stderr
        assert "trained" in outputs[0][0] and not outputs[1][0]  # rank 0 reports, alone

    both_nodes(*SETTINGS, "--epochs", "1")
    assert load_checkpoint(RunPaths(out).last)["epoch"] == 1
    both_nodes("--resume", "--epochs", "2", "--quiet")
    assert load_checkpoint(RunPaths(out).last)["nproc"] == 2
    assert_close_runs(reference, out, 1e-5)
