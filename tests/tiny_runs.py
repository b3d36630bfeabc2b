"""Settings of the tiny training runs shared by the tests of iresflow.train, and a way to make a
run look as if it was written before a setting existed."""

from pathlib import Path

from iresflow.models.config import ModelConfig
from iresflow.train.checkpoint import load_checkpoint, save_checkpoint
from iresflow.train.config import TrainConfig
from iresflow.train.paths import RunPaths

#: One block of width 8 on a dozen sequences, one epoch of one pass on the CPU; one model (no
#: alternative: tests/test_train_selection.py trains the two candidates of a default run).
TINY = TrainConfig(
    model=ModelConfig(n_blocks=1, hidden=8), max_train=12, max_eval=6, batch_size=6, epochs=1,
    min_steps=1, device="cpu", scheduler="plateau", eval_method="exact", alternative="none",
)


def forget_setting(folder: Path, name: str) -> RunPaths:
    """Remove the setting ``name`` from a run's checkpoints and ``config.toml``, as a run
    written before the setting existed would lack it; returns the run's paths."""
    for path in folder.glob("checkpoints/*.pt"):
        state = load_checkpoint(path)
        del state["config"][name]
        save_checkpoint(state, path)
    paths = RunPaths(folder)
    paths.config.write_text("\n".join(line for line in paths.config.read_text().splitlines()
                                      if not line.startswith(f"{name} =")))
    return paths
