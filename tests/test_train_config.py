"""Training configuration: TOML round trips, overrides, validation, one source of model settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from iresflow.train.config import ConfigError, TrainConfig


def test_config_toml_round_trip(tmp_path: Path) -> None:
    config = TrainConfig(
        data='odd "name" é.npz', heads=3, max_train=7, lr=1e-5, ema=0.99, clip=0.0,
        tensorboard=True, scheduler="cosine", coeff=0.5,
    )
    path = tmp_path / "run.toml"
    config.save(path)
    assert TrainConfig.from_toml(path) == config
    assert TrainConfig.from_toml_string(TrainConfig().to_toml()) == TrainConfig()


def test_config_replace_overrides_file_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('epochs = 3\nhidden = 8\nlr = 1\n', encoding="utf-8")
    config = TrainConfig.from_toml(path).replace(epochs=1)
    assert (config.epochs, config.hidden, config.lr) == (1, 8, 1.0)
    assert isinstance(config.lr, float)  # integers are accepted for float settings
    with pytest.raises(ConfigError, match="coeff"):
        config.replace(coeff=1.0)
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        config.replace(colour="red")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1\n", "unknown option 'colour'"),
        ("epochs = \n", "invalid TOML"),
        ("[model]\nhidden = 8\n", r"found table \[model\]"),
        ('lr = "fast"\n', "lr must be of type float"),
        ("epochs = true\n", "epochs must be of type int"),
        ("epochs = 0\n", "epochs must be >= 1"),
        ('attention = "dot"\n', "attention must be one of"),
        ('device = "tpu"\n', "device must be"),
        ("lr = inf\n", "lr must be finite"),
    ],
)
def test_config_rejects_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_toml(path)


def test_config_missing_file_and_incompatible_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        TrainConfig.from_toml(tmp_path / "missing.toml")
    config = TrainConfig()
    assert config.incompatible_fields(config.replace(epochs=99, patience=0)) == []
    assert config.incompatible_fields(config.replace(hidden=9, lr=0.1)) == ["hidden", "lr"]
