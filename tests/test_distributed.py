"""Data-parallel training: 2 CPU processes (gloo) against one process on the same batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iresflow.models.config import ModelConfig
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import World, launch, lead_process, process_count, shard
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from tests.oracles import assert_close_runs

# 13 sequences in batches of 6: the last global batch has one sequence, so rank 1 sits it out.
TINY = TrainConfig(
    model=ModelConfig(n_blocks=1, hidden=8, logdet="exact"), max_train=13, max_eval=6,
    batch_size=6, epochs=2, device="cpu", eval_method="exact", scheduler="plateau",
    alternative="none",
)


def test_shards_cover_every_global_batch_once() -> None:
    for size in (1, 2, 3):
        for batch in (1, 2, 5, 6):
            index = torch.randperm(batch, generator=torch.Generator().manual_seed(batch))
            parts = [shard(index, World(rank, size)) for rank in range(size)]
            kept = torch.cat([part for part, weight in parts if weight > 0])
            assert sorted(kept.tolist()) == sorted(index.tolist())
            assert all(weight == 0.0 or len(part) > 0 for part, weight in parts)


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


def test_the_launcher_counts_processes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    assert (process_count(1), process_count(3), lead_process()) == (1, 3, True)
    assert launch(divmod, 1, "cpu", 7, 2) == (3, 1)  # one process: runs here
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert process_count(1) == process_count(2) == 2  # under torchrun the launch decides
    assert not lead_process()  # rank 1 of the launch reports nothing
    with pytest.raises(ConfigError, match="torchrun started 2 processes"):
        process_count(3)
    with pytest.raises(ConfigError, match="torchrun started 2 processes"):
        launch(divmod, 3, "cpu", 7, 2)


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    # float32 model: the shards sum in another order, so agreement is to float32 precision.
    train(TINY.replace(epochs=1), tmp_path / "single", progress=False)
    result = train(TINY.replace(epochs=1, nproc=2), tmp_path / "ddp", progress=False)
    assert result.epochs == 1 and result.history[0]["skipped_steps"] == 0
    assert_close_runs(tmp_path / "single", tmp_path / "ddp", 1e-5)
    state = load_checkpoint(RunPaths(tmp_path / "ddp").last)
    assert state["nproc"] == 2 and len(state["rng_ranks"]) == 2


@pytest.mark.slow
def test_both_candidates_of_a_run_train_in_two_processes(tmp_path: Path) -> None:
    config = TINY.replace(epochs=1, alternative="recurrent")
    single = train(config, tmp_path / "single", progress=False)
    ddp = train(config.replace(nproc=2), tmp_path / "ddp", progress=False)
    assert [r.name for r in ddp.selection] == ["configured", "recurrent"]
    for ours, theirs in zip(ddp.selection, single.selection, strict=True):
        assert ours.best_val_nll == pytest.approx(theirs.best_val_nll, rel=1e-5)
    for name in ("", "candidates/configured", "candidates/recurrent"):
        assert_close_runs(tmp_path / "single" / name, tmp_path / "ddp" / name, 1e-5)
    assert (tmp_path / "ddp" / "selection.json").is_file()


@pytest.mark.slow
def test_a_label_conditional_run_in_two_processes_equals_one_process(tmp_path: Path) -> None:
    # every rank gives its shard's labels to the DDP-wrapped log-density
    config = TINY.replace(epochs=1, condition="label")
    train(config, tmp_path / "single", progress=False)
    train(config.replace(nproc=2), tmp_path / "ddp", progress=False)
    assert_close_runs(tmp_path / "single", tmp_path / "ddp", 1e-5)
    assert load_checkpoint(RunPaths(tmp_path / "ddp").last)["config"]["condition"] == "label"


@pytest.mark.slow
def test_ddp_resume_matches_one_process_and_reports_errors(tmp_path: Path) -> None:
    train(TINY, tmp_path / "single", progress=False)
    ddp = TINY.replace(nproc=2)
    train(ddp.replace(epochs=1), tmp_path / "ddp", progress=False)
    resumed = train(ddp, tmp_path / "ddp", resume=True, progress=False)
    assert resumed.epochs == 2 and len(resumed.history) == 2
    assert_close_runs(tmp_path / "single", tmp_path / "ddp", 1e-5)
    with pytest.raises(ConfigError, match="cannot resume .*nproc"):
        train(TINY.replace(epochs=3), tmp_path / "ddp", resume=True, progress=False)
    with pytest.raises(ConfigError, match="not empty"):  # raised in a worker, re-raised here
        train(ddp, tmp_path / "ddp", progress=False)


@pytest.mark.slow
def test_roulette_training_resumes_exactly_under_ddp(tmp_path: Path) -> None:
    # Per-rank estimator streams (seed + 1 + rank) are saved and restored for every rank.
    config = TINY.replace(model=TINY.model.replace(logdet="roulette"), nproc=2, seed=4)
    train(config, tmp_path / "straight", progress=False)
    train(config.replace(epochs=1), tmp_path / "resumed", progress=False)
    train(config, tmp_path / "resumed", resume=True, progress=False)
    assert_close_runs(tmp_path / "straight", tmp_path / "resumed", 0.0)
