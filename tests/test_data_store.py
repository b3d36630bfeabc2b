"""Sequence stores: memory-mapped data give what the in-memory path gives; bounded residency."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.cli import main, parse_train_config
from iresflow.data.batching import epoch_batches, epoch_steps
from iresflow.data.datasets import load_dataset
from iresflow.data.preprocessing import Standardization
from iresflow.data.store import SequenceStore, StoredSplit, is_store, write_store
from iresflow.models.config import ModelConfig
from iresflow.runs.load import load_run
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.likelihood import trimmed_batch
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths


def _sequences(count: int, longest: int, features: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Padded float64 sequences ``(B, N, D)`` with a non-zero mean, their lengths and mask."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator)
    x = torch.randn(count, longest, features, generator=generator, dtype=torch.float64) * 3 + 5
    mask = torch.arange(longest) < lengths.unsqueeze(1)
    return torch.where(mask.unsqueeze(-1), x, 0.0), lengths, mask


def _store_and_npz(folder: Path, count: int = 40, seed: int = 0) -> tuple[Path, Path]:
    """The same sequences as a store (float64) and as an .npz file."""
    x, lengths, _ = _sequences(count, 9, 3, seed)
    np.savez(folder / "data.npz", x=x.numpy(), lengths=lengths.numpy())
    write_store(folder / "store", lengths, [x[b, : lengths[b]] for b in range(count)],
                dtype=torch.float64)
    return folder / "store", folder / "data.npz"


def test_store_reads_back_every_sequence(tmp_path: Path) -> None:
    x, lengths, mask = _sequences(23, 7, 2, seed=1)
    chunks = torch.cat([x[b, : lengths[b]] for b in range(23)]).split(5)  # chunks across rows
    write_store(tmp_path, lengths, chunks, dtype=torch.float64)
    store = SequenceStore(tmp_path)
    assert is_store(tmp_path) and len(store) == 23 and store.features == 2
    assert store.max_len == int(lengths.max())
    index = torch.tensor([4, 0, 22, 4])
    got, got_mask = store.read(index)
    longest = int(lengths[index].max())
    assert torch.equal(got_mask, mask[index, :longest])
    assert torch.equal(got, x[index, :longest])
    frames = torch.cat(list(store.frame_chunks(torch.arange(23), max_frames=6)))
    assert torch.equal(frames, x[mask])


def test_float32_store_matches_float32_values(tmp_path: Path) -> None:
    x, lengths, mask = _sequences(5, 4, 3, seed=2)
    write_store(tmp_path, lengths, [x[mask]])
    assert np.load(tmp_path / "values.npy").dtype == np.float32
    got, _ = SequenceStore(tmp_path).read(torch.arange(5))
    assert torch.equal(got, x.float().double()[:, : got.shape[1]])


@pytest.mark.parametrize(
    ("lengths", "chunks", "error", "match"),
    [
        (torch.tensor([2.0]), [torch.ones(2, 1)], TypeError, "lengths must be an int"),
        (torch.tensor([0, 2]), [torch.ones(2, 1)], ValueError, "every length >= 1"),
        (torch.tensor([2, 2]), [torch.ones(3, 1)], ValueError, "hold 3 frames"),
        (torch.tensor([1]), [torch.ones(2, 1)], ValueError, "more than"),
        (torch.tensor([2]), [torch.ones(1, 1), torch.ones(1, 2)], ValueError, "D = 1"),
        (torch.tensor([1]), [torch.tensor([[math.nan]])], ValueError, "finite"),
        (torch.tensor([1]), [torch.ones(1)], TypeError, r"\(t, D\)"),
    ],
)
def test_write_store_rejects_bad_input(
    tmp_path: Path, lengths: torch.Tensor, chunks: list[torch.Tensor], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        write_store(tmp_path, lengths, chunks)


def test_malformed_stores_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a sequence store"):
        SequenceStore(tmp_path)
    np.save(tmp_path / "values.npy", np.zeros((3, 2), dtype=np.float32))
    np.save(tmp_path / "lengths.npy", np.array([1, 1]))
    with pytest.raises(ValueError, match="sum to the 3 frames"):
        SequenceStore(tmp_path)
    np.save(tmp_path / "lengths.npy", np.array([1, 2]))
    with pytest.raises(ValueError, match="memory_cap"):
        SequenceStore(tmp_path, memory_cap=-1)
    store = SequenceStore(tmp_path)
    with pytest.raises(ValueError, match=r"index must lie in \[0, 2\)"):
        store.read(torch.tensor([2]))
    with pytest.raises(TypeError, match="integer"):
        store.read(torch.tensor([0.0]))


def test_streaming_standardisation_equals_the_whole_fit() -> None:
    # A large offset: a naive sum-of-squares pass would lose the variance in float64.
    x, _, mask = _sequences(50, 8, 4, seed=3)
    x = torch.where(mask.unsqueeze(-1), x + 1e8, 0.0)
    whole = Standardization.fit(x, mask)
    for size in (1, 7, 1000):
        streamed = Standardization.fit_chunks(x[mask].split(size))
        torch.testing.assert_close(streamed.mean, whole.mean, rtol=1e-14, atol=0)
        torch.testing.assert_close(streamed.std, whole.std, rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="at least two"):
        Standardization.fit_chunks([torch.ones(1, 2)])
    with pytest.raises(ValueError, match="constant"):
        Standardization.fit_chunks([torch.ones(3, 2)])


def test_stored_split_is_the_standardised_in_memory_split(tmp_path: Path) -> None:
    x, lengths, mask = _sequences(12, 6, 2, seed=4)
    write_store(tmp_path, lengths, [x[mask]], dtype=torch.float64)
    scale = Standardization.fit(x, mask)
    split = StoredSplit(SequenceStore(tmp_path), torch.tensor([3, 5, 7, 9]), scale)
    expected_x, expected_jacobian = scale.forward(x[[3, 5, 7, 9]], mask[[3, 5, 7, 9]])
    torch.testing.assert_close(split.log_jacobian, expected_jacobian, rtol=1e-14, atol=1e-14)
    got, got_mask = trimmed_batch(split, torch.tensor([2, 0]), torch.device("cpu"))
    longest = int(lengths[[7, 3]].max())
    assert torch.equal(got_mask, mask[[7, 3], :longest])
    torch.testing.assert_close(got, expected_x[[2, 0], :longest].float())
    assert torch.equal(split.batch_mask(torch.tensor([2, 0])), got_mask)
    part = split.subset(torch.tensor([False, True, False, True]))
    assert part.index.tolist() == [5, 9] and torch.equal(part.frames, lengths[[5, 9]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_stored_batches_go_to_the_gpu(tmp_path: Path) -> None:
    x, lengths, mask = _sequences(6, 5, 2, seed=5)
    write_store(tmp_path, lengths, [x[mask]])
    split = StoredSplit(SequenceStore(tmp_path), torch.arange(6), Standardization.fit(x, mask))
    got, got_mask = trimmed_batch(split, torch.tensor([1, 4]), torch.device("cuda"))
    assert got.is_cuda and got_mask.is_cuda
    cpu, _ = trimmed_batch(split, torch.tensor([1, 4]), torch.device("cpu"))
    torch.testing.assert_close(got.cpu(), cpu)


def test_store_dataset_equals_the_npz_dataset(tmp_path: Path) -> None:
    store, npz = _store_and_npz(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # small splits
        stored = load_dataset(str(store), seed=3)
        memory = load_dataset(str(npz), seed=3)
    assert (stored.features, stored.max_len, stored.unit) == (3, 9, "nats/frame")
    torch.testing.assert_close(stored.preprocessing.mean, memory.preprocessing.mean)
    torch.testing.assert_close(stored.preprocessing.std, memory.preprocessing.std)
    for name in ("train", "val", "test"):
        a, b = getattr(stored, name), getattr(memory, name)
        assert len(a) == len(b) and torch.equal(a.frames, b.frames)
        torch.testing.assert_close(a.x, b.x[:, : a.x.shape[1]])
        log_prob = -torch.arange(len(a), dtype=torch.float64)
        assert stored.nll(log_prob, a) == pytest.approx(memory.nll(log_prob, b), rel=1e-12)
    with pytest.raises(ValueError, match="memory_cap"):
        load_dataset(str(store), memory_cap=-1)


def test_training_on_a_store_equals_training_in_memory(tmp_path: Path) -> None:
    store, npz = _store_and_npz(tmp_path)
    # The automatic input settings need the splits in memory (a store trains with the defaults
    # they fall back to); explicit ones make both runs the same model.
    config = TrainConfig(
        model=ModelConfig(n_blocks=1, hidden=8, logdet="exact", ar_order=3, position_norm="off"),
        batch_size=8, epochs=2,
        device="cpu", eval_method="exact", scheduler="plateau", bucket=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        train(config.replace(data=str(npz)), tmp_path / "run-memory", progress=False)
        train(config.replace(data=str(store), memory_cap=1), tmp_path / "run-store", progress=False)
    a = load_checkpoint(RunPaths(tmp_path / "run-memory").last)
    b = load_checkpoint(RunPaths(tmp_path / "run-store").last)
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=1e-6, atol=1e-6)
    for row, other in zip(a["history"], b["history"], strict=True):
        assert other["train_nll"] == pytest.approx(row["train_nll"], rel=1e-6)
        assert other["val_nll"] == pytest.approx(row["val_nll"], rel=1e-6)


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's memory maps of ``path`` (Linux ``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):  # a mapping's header
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux /proc")
def test_memory_cap_bounds_the_resident_pages_of_the_map(tmp_path: Path) -> None:
    count, length, features = 512, 64, 128  # 512 * 64 * 128 * 4 bytes = 16 MiB of frames
    lengths = torch.full((count,), length)
    write_store(tmp_path, lengths, [torch.randn(count * length, features)])
    values = (tmp_path / "values.npy").resolve()
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0))
    uncapped, capped = SequenceStore(tmp_path), SequenceStore(tmp_path, memory_cap=4)
    for store in (uncapped, capped):
        for index in order.split(16):
            store.read(index)
    resident_both = _resident_kib(values)  # both maps of the same file, summed
    del uncapped
    resident_capped = _resident_kib(values)
    assert resident_both - resident_capped >= 15 * 1024  # the uncapped map kept ~16 MiB
    assert resident_capped <= 4 * 1024  # whatever the kernel maps per fault


def test_unbucketed_batches_are_the_plain_shuffle() -> None:
    frames = torch.randint(1, 20, (37,), generator=torch.Generator().manual_seed(0))
    batches = epoch_batches(frames, 5, torch.Generator().manual_seed(7))
    expected = torch.randperm(37, generator=torch.Generator().manual_seed(7)).split(5)
    assert all(torch.equal(a, b) for a, b in zip(batches, expected, strict=True))


def test_buckets_visit_every_sequence_once_with_less_padding() -> None:
    frames = torch.randint(1, 100, (203,), generator=torch.Generator().manual_seed(1))

    def padding(batches: list[torch.Tensor]) -> int:
        return sum(int(frames[b].max()) * len(b) - int(frames[b].sum()) for b in batches)

    plain = epoch_batches(frames, 8, torch.Generator().manual_seed(2))
    for bucket in (1, 4, 100):  # one batch per window: sorting inside a batch changes nothing
        batches = epoch_batches(frames, 8, torch.Generator().manual_seed(2), bucket=bucket)
        again = epoch_batches(frames, 8, torch.Generator().manual_seed(2), bucket=bucket)
        assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
        assert len(batches) == math.ceil(203 / 8)
        assert sorted(torch.cat(batches).tolist()) == list(range(203))
        if bucket == 1:
            assert padding(batches) == padding(plain)
        else:
            assert padding(batches) < padding(plain) / 2
    with pytest.raises(ValueError, match="bucket"):
        epoch_batches(frames, 8, torch.Generator(), bucket=-1)


@pytest.mark.parametrize("bucket", [0, 3])
def test_an_epoch_of_small_data_is_several_fresh_passes(bucket: int) -> None:
    frames = torch.randint(1, 20, (11,), generator=torch.Generator().manual_seed(3))
    one = epoch_batches(frames, 4, torch.Generator().manual_seed(5), bucket=bucket)
    batches = epoch_batches(frames, 4, torch.Generator().manual_seed(5), bucket=bucket,
                            min_steps=7)
    assert len(one) == 3 and len(batches) == epoch_steps(11, 4, 7) == 9
    passes = [torch.cat(batches[i:i + 3]) for i in range(0, 9, 3)]
    for visit in passes:  # every pass holds every sequence once
        assert sorted(visit.tolist()) == list(range(11))
    assert all(torch.equal(a, b) for a, b in zip(batches[:3], one, strict=True))
    assert not torch.equal(passes[1], passes[2])  # each pass shuffled afresh
    assert len(epoch_batches(frames, 4, torch.Generator(), bucket=bucket, min_steps=3)) == 3


def test_epoch_steps_rejects_bad_counts() -> None:
    assert epoch_steps(12, 4) == 3 and epoch_steps(12, 4, 4) == 6 and epoch_steps(5, 8, 1) == 1
    for args, name in (((0, 4, 1), "sequences"), ((5, 0, 1), "batch_size"),
                       ((5, 4, 0), "min_steps"), ((5, 4, 2.0), "min_steps"),
                       ((True, 4, 1), "sequences")):
        with pytest.raises(ValueError, match=name):
            epoch_steps(*args)
    with pytest.raises(ValueError, match="frames"):
        epoch_batches(torch.zeros(0, dtype=torch.long), 4, torch.Generator())


def test_store_settings_from_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = _store_and_npz(tmp_path)
    monkeypatch.chdir(tmp_path)  # a relative folder is stored as an absolute path
    config = parse_train_config(["--data", "store", "--memory-cap", "64", "--bucket", "4"])
    assert config.data == str(store.resolve())
    assert (config.memory_cap, config.bucket) == (64, 4)
    with pytest.raises(ConfigError, match="memory_cap must be >= 0"):
        TrainConfig(memory_cap=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dataset = load_data(TrainConfig(data=str(store), max_train=5))
    assert len(dataset.train) == 5 and isinstance(dataset.train, StoredSplit)


def test_the_command_line_trains_evaluates_and_plots_a_store(tmp_path: Path) -> None:
    store, _ = _store_and_npz(tmp_path, count=60)
    run, scores = tmp_path / "run", tmp_path / "scores.npz"
    tiny = ["--n-blocks", "1", "--hidden", "8", "--epochs", "1", "--batch-size", "8",
            "--device", "cpu", "--eval-method", "exact", "--quiet", "--memory-cap", "1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert main(["train", "--data", str(store), "--out", str(run), *tiny]) == 0
        assert main(["evaluate", str(run), "--scores", str(scores)]) == 0
        assert main(["sample", str(run), "--num", "2"]) == 0
    assert (run / "plots" / "marginals.png").is_file() and (run / "samples.png").is_file()
    evaluation = json.loads((run / "evaluation.json").read_text())["test"]["exact"]
    log_prob = np.load(scores)["log_prob"]
    assert log_prob.shape == (evaluation["sequences"],)
    frames = float(load_run(run).dataset.test.frames.sum())
    assert -log_prob.sum() / frames == pytest.approx(evaluation["nll"], rel=1e-9)
