"""The run folder: where a run keeps its settings, checkpoints, metrics and figures."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig

__all__ = ["RunPaths", "check_run_folder", "empty_run_folder", "prepare_run_folder"]


@dataclass(frozen=True)
class RunPaths:
    """The files of a run folder.

    Attributes:
        root: The run folder.

    Example:
        >>> RunPaths(Path("runs/vowels")).best.as_posix()
        'runs/vowels/checkpoints/best.pt'
    """

    root: Path

    @property
    def config(self) -> Path:
        """``config.toml``: the settings of the run."""
        return self.root / "config.toml"

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``: ``last.pt`` and ``best.pt``."""
        return self.root / "checkpoints"

    @property
    def last(self) -> Path:
        """The checkpoint written after every epoch."""
        return self.checkpoints / "last.pt"

    @property
    def best(self) -> Path:
        """The checkpoint of the epoch with the lowest validation NLL."""
        return self.checkpoints / "best.pt"

    def checkpoint(self, which: str) -> Path:
        """The checkpoint to load for ``which`` = ``"best"`` or ``"last"``: ``best`` falls back
        to ``last`` in a run that has no best checkpoint yet."""
        return self.best if which == "best" and self.best.is_file() else self.last

    @property
    def metrics_jsonl(self) -> Path:
        """One JSON object per epoch."""
        return self.root / "metrics.jsonl"

    @property
    def metrics_csv(self) -> Path:
        """The same metrics as a CSV table."""
        return self.root / "metrics.csv"

    @property
    def evaluation(self) -> Path:
        """``evaluation.json``: results of ``iresflow evaluate``."""
        return self.root / "evaluation.json"

    @property
    def plots(self) -> Path:
        """``plots/``: PNG figures."""
        return self.root / "plots"

    @property
    def tensorboard(self) -> Path:
        """``tensorboard/``: event files, when enabled."""
        return self.root / "tensorboard"

    @property
    def candidates(self) -> Path:
        """``candidates/``: the run folder of every candidate, with an ``alternative``."""
        return self.root / "candidates"

    @property
    def selection(self) -> Path:
        """``selection.json``: how every candidate ended, with an ``alternative``."""
        return self.root / "selection.json"

    def is_run(self) -> bool:
        """Whether the folder holds a run (a config or checkpoint)."""
        return self.config.is_file() or self.checkpoints.is_dir()


def check_run_folder(paths: RunPaths, *, resume: bool, overwrite: bool) -> None:
    """Refuse a run folder that cannot be used, before anything is loaded or deleted.

    Args:
        paths: The run folder.
        resume: Whether the run continues the one in the folder.
        overwrite: Whether an existing run in the folder is to be replaced.

    Raises:
        ConfigError: ``resume`` and ``overwrite`` together; the path is a file or lies under
            one; the folder (or the nearest existing folder above it) is not writable; a
            non-empty folder without ``resume`` or ``overwrite``; a folder to overwrite that
            does not hold a run.

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "notes.txt"
        >>> _ = file.write_text("x")
        >>> check_run_folder(RunPaths(file), resume=False, overwrite=False)
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: run folder ... is a file, not a folder
    """
    if resume and overwrite:
        raise ConfigError("resume and overwrite exclude each other (--resume, --overwrite)")
    root = paths.root
    if root.exists() and not root.is_dir():
        raise ConfigError(f"run folder {root} is a file, not a folder")
    existing = next(parent for parent in (root, *root.parents) if parent.exists())
    if not existing.is_dir():
        raise ConfigError(f"cannot create run folder {root}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write to run folder {root}: {existing} is not writable")
    if resume or not (root.exists() and any(root.iterdir())):
        return
    if not overwrite:
        raise ConfigError(
            f"run folder {root} is not empty; continue it with resume (--resume) or start "
            "again with overwrite (--overwrite)"
        )
    if not paths.is_run():
        raise ConfigError(f"refusing to overwrite {root}: it does not hold a run")


def prepare_run_folder(
    paths: RunPaths, config: TrainConfig, *, resume: bool, overwrite: bool
) -> dict[str, Any] | None:
    """Check or create the run folder; return the checkpoint state to resume from.

    Args:
        paths: The run folder.
        config: The settings of the run to start or continue.
        resume: Continue from ``paths.last``; only the settings in
            :data:`~iresflow.train.config.RESUMABLE_FIELDS` may differ from the checkpoint's.
        overwrite: Delete an existing run in the folder first.

    Returns:
        The state of ``paths.last`` when resuming, else ``None`` (the folder then exists and is
        empty). A run killed before its first checkpoint (``config.toml`` but no ``last.pt``)
        resumes from its saved settings with ``None``: it starts from epoch 0.

    Raises:
        ConfigError: ``resume`` and ``overwrite`` together, changed settings, a non-empty folder
            without ``overwrite``, or a folder to overwrite that does not hold a run.
        CheckpointError: the checkpoint to resume from is missing (and no ``config.toml`` either)
            or unreadable.

    Example:
        >>> import tempfile
        >>> paths = RunPaths(Path(tempfile.mkdtemp()) / "run")
        >>> prepare_run_folder(paths, TrainConfig(), resume=False, overwrite=False) is None
        True
        >>> paths.root.is_dir()
        True
    """
    check_run_folder(paths, resume=resume, overwrite=overwrite)
    if resume:
        # A run killed before its first checkpoint left only its config: it starts from that.
        started = paths.config.is_file() and not paths.last.exists()
        state = None if started else load_checkpoint(paths.last)
        saved = (TrainConfig.from_toml(paths.config, stored=True) if started
                 else TrainConfig.from_dict(state["config"], stored=True))
        if saved.val_fraction is None:  # automatic: what the same data resolve to (config's)
            saved = saved.replace(val_fraction=config.val_fraction)
        if saved.model.position_norm == "auto":  # likewise decided by the same data
            saved = saved.replace(
                model=saved.model.replace(position_norm=config.model.position_norm))
        changed = saved.incompatible_fields(config)
        if changed:
            raise ConfigError(
                f"cannot resume {paths.root} with different settings: {', '.join(changed)} "
                "(only epochs, patience, device, tensorboard, max_eval, on_nan and memory_cap may "
                "change)"
            )
        return state
    empty_run_folder(paths)
    return None


def empty_run_folder(paths: RunPaths) -> None:
    """Create the run folder, or empty it: call after :func:`check_run_folder` allowed it
    (``overwrite`` is set and the folder holds a run)."""
    if paths.root.exists() and any(paths.root.iterdir()):
        shutil.rmtree(paths.root)
    paths.root.mkdir(parents=True, exist_ok=True)
