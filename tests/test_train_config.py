"""Training configuration: TOML round trips, overrides, validation, one source of model settings."""

from __future__ import annotations

import ast
import dataclasses
import pickle
import re
from pathlib import Path

import pytest

import iresflow
from iresflow._settings import check_device
from iresflow.cli import parse_train_config
from iresflow.models.config import ModelConfig
from iresflow.runs.settings import RunSettings
from iresflow.train.config import MODEL_SETTINGS, ConfigError, TrainConfig
from iresflow.train.factories import resolve_device


def test_config_toml_round_trip(tmp_path: Path) -> None:
    config = TrainConfig(
        data='odd "name" é.npz', model=ModelConfig(heads=3, coeff=0.5), max_train=7, lr=1e-5,
        ema=0.99, clip=0.0, tensorboard=True, scheduler="cosine",
    )
    path = tmp_path / "run.toml"
    config.save(path)
    assert TrainConfig.from_toml(path) == config
    assert TrainConfig.from_toml_string(TrainConfig().to_toml()) == TrainConfig()


def test_config_replace_overrides_file_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('epochs = 3\nhidden = 8\nlr = 1\n', encoding="utf-8")
    config = TrainConfig.from_toml(path).replace(epochs=1)
    assert (config.epochs, config.model.hidden, config.lr) == (1, 8, 1.0)
    assert isinstance(config.lr, float)  # integers are accepted for float settings
    with pytest.raises(ConfigError, match="coeff"):
        config.replace(model=config.model.replace(coeff=1.0))
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
        ('base = "cauchy"\n', "base must be one of normal, student-t, multivariate-t"),
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
    changed = config.replace(model=config.model.replace(hidden=9), lr=0.1)
    assert config.incompatible_fields(changed) == ["hidden", "lr"]


# -- one source of model settings -----------------------------------------------------------

MODEL_TOML = """
n_blocks = 2
hidden = 16
heads = 2
coeff = 0.5
attention = "lipschitznorm"
positional = "learned"
max_len = 40
logdet = "exact"
n_power_iterations = 3
spectral_norm = "power"
base = "student-t"
lr = 0.01
"""
MODEL_FLAGS = [
    "--n-blocks", "2", "--hidden", "16", "--heads", "2", "--coeff", "0.5",
    "--attention", "lipschitznorm", "--positional", "learned", "--max-len", "40",
    "--logdet", "exact", "--n-power-iterations", "3", "--spectral-norm", "power",
    "--base", "student-t", "--lr", "0.01",
]
MODEL_PYTHON = ModelConfig(
    n_blocks=2, hidden=16, heads=2, coeff=0.5, attention="lipschitznorm", positional="learned",
    max_len=40, logdet="exact", n_power_iterations=3, spectral_norm="power", base="student-t",
)


def test_model_settings_agree_from_toml_cli_and_python(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(MODEL_TOML, encoding="utf-8")
    from_toml = TrainConfig.from_toml(path)
    from_flags = parse_train_config(MODEL_FLAGS)
    from_file_and_flags = parse_train_config(["--config", str(path)])
    assert from_toml.model == from_flags.model == from_file_and_flags.model == MODEL_PYTHON
    assert from_toml == from_flags == TrainConfig(model=MODEL_PYTHON, lr=0.01)
    assert from_toml.model.n_blocks == 2 and from_toml.model.logdet == "exact"
    # Untouched settings are ModelConfig's defaults everywhere.
    defaults = (TrainConfig(), TrainConfig.from_toml_string(""), parse_train_config([]))
    assert all(config.model == ModelConfig() for config in defaults)
    # Flags override the file, setting by setting.
    changed = parse_train_config(["--config", str(path), "--hidden", "8", "--heads", "none"])
    assert changed.model == MODEL_PYTHON.replace(hidden=8, heads=None)


def test_relative_window_from_toml_flags_and_python(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('relative_window = 4\nlayers = ["attention", "mlp"]\n', encoding="utf-8")
    expected = ModelConfig(relative_window=4, layers=("attention", "mlp"))
    from_flags = parse_train_config(["--relative-window", "4", "--layers", "attention,mlp"])
    assert TrainConfig.from_toml(path).model == from_flags.model == expected
    assert TrainConfig.from_toml_string(from_flags.to_toml()) == from_flags
    assert ModelConfig.from_dict(expected.to_dict()) == expected
    assert ModelConfig().relative_window is None  # no bias by default
    cleared = parse_train_config(["--config", str(path), "--relative-window", "none"])
    assert cleared.model == expected.replace(relative_window=None)
    with pytest.raises(ConfigError, match="relative_window must be >= 1"):
        ModelConfig(relative_window=0)
    with pytest.raises(ConfigError, match="relative_window needs attention = l2"):
        TrainConfig.from_dict({"relative_window": 2, "attention": "lipschitznorm",
                               "layers": ("attention", "mlp")})


def test_flat_settings_round_trip_through_dicts_and_pickles() -> None:
    config = TrainConfig(model=MODEL_PYTHON, epochs=3)
    flat = config.to_dict()
    assert "model" not in flat and "features" not in flat
    assert [name for name in flat if name in MODEL_SETTINGS] == list(MODEL_SETTINGS)
    assert {name: flat[name] for name in MODEL_SETTINGS} == {
        name: getattr(MODEL_PYTHON, name) for name in MODEL_SETTINGS
    }
    assert TrainConfig.from_dict(flat) == config
    assert pickle.loads(pickle.dumps(config)) == config  # data-parallel runs pickle it
    assert [f.name for f, _ in TrainConfig.settings()] == list(flat)
    assert config.replace(model=config.model.replace(hidden=4)).model == MODEL_PYTHON.replace(
        hidden=4)
    assert config.replace(model=ModelConfig()).model == ModelConfig()
    flat_override = TrainConfig.from_dict({**flat, "hidden": 4, "lr": 0.5})
    assert flat_override == config.replace(model=config.model.replace(hidden=4), lr=0.5)


def test_model_settings_are_validated_by_model_config() -> None:
    with pytest.raises(ConfigError, match="unknown option 'hiden' .*hidden"):
        TrainConfig.from_dict({"hiden": 8})
    with pytest.raises(ConfigError, match="unknown option 'features'"):
        TrainConfig.from_dict({"features": 12})
    with pytest.raises(ConfigError, match="unknown option 'model'"):  # the flat form is flat
        TrainConfig.from_dict({"model": ModelConfig()})
    with pytest.raises(ConfigError, match="comes from the data"):
        TrainConfig(model=ModelConfig(features=12))
    with pytest.raises(ConfigError, match="model must be of type ModelConfig"):
        TrainConfig(model={"hidden": 8})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n_blocks must be >= 1"):
        TrainConfig.from_dict({"n_blocks": 0})
    with pytest.raises(ConfigError, match="logdet must be one of"):
        TrainConfig.from_toml_string('logdet = "fast"')
    with pytest.raises(ConfigError, match="unknown option 'hidden'"):  # replace: own fields
        TrainConfig().replace(hidden=8)
    with pytest.raises(AttributeError, match="hidden"):  # no flat reads: config.model.hidden
        _ = TrainConfig().hidden  # type: ignore[attr-defined]


def test_every_model_default_is_defined_once() -> None:
    """ModelConfig defines each model setting; the training code and the CLI only refer to it."""
    root = Path(iresflow.__file__).parent
    definitions = _setting_definitions(root / "models" / "config.py")
    assert sorted(definitions) == sorted(MODEL_SETTINGS + ("features",))
    assert all(len(lines) == 1 for lines in definitions.values()), definitions
    for path in [*sorted((root / "train").glob("*.py")), root / "cli.py"]:
        assert _setting_definitions(path) == {}, path
    # The flags and the TOML keys are derived from ModelConfig's own field definitions.
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for field, _ in TrainConfig.settings():
        if field.name in MODEL_SETTINGS:
            assert field is model_fields[field.name]


def _setting_definitions(path: Path) -> dict[str, list[int]]:
    """Lines of ``path`` that give a model setting a value: a class-level field, a parameter
    default or a keyword argument with a literal value."""
    names = set(MODEL_SETTINGS) | {"features"}
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                target = getattr(statement, "target", None)
                if isinstance(statement, ast.AnnAssign) and isinstance(target, ast.Name):
                    if target.id in names:
                        found.setdefault(target.id, []).append(statement.lineno)
        elif isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            defaulted = positional[len(positional) - len(node.defaults):]
            defaulted += [
                a for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d is not None
            ]
            for argument in defaulted:
                if argument.arg in names:
                    found.setdefault(argument.arg, []).append(argument.lineno)
        elif isinstance(node, ast.keyword) and node.arg in names:
            if isinstance(node.value, ast.Constant):
                found.setdefault(node.arg, []).append(node.value.lineno)
    return found


def test_the_cli_docs_table_states_every_default() -> None:
    """docs/cli.md lists every setting with its default; automatic settings as words."""
    table = {}
    page = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    train_table = page.split("<!-- settings: TrainConfig -->")[1].split("<!-- /settings -->")[0]
    for line in train_table.splitlines():
        match = re.match(r"^\| `([a-z_]+)` \(`--[a-z-]+`(?:, `--no-[a-z-]+`)?\) \| ([^|]+) \|",
                         line)
        if match:
            table[match.group(1)] = match.group(2).strip().strip("`")
    for name, value in TrainConfig().to_dict().items():
        assert name in table, f"docs/cli.md does not list {name}"
        if value is None or isinstance(value, bool):
            continue
        text = ",".join(value) if isinstance(value, tuple) else str(value)
        if isinstance(value, float):
            assert float(table[name]) == value, name
        else:
            assert table[name] == text, name


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "CPU", "cuda:"])
def test_every_device_setting_has_the_one_device_check(name: str) -> None:
    """TrainConfig, RunSettings and the device resolver refuse a device name alike."""
    with pytest.raises(ConfigError) as expected:
        check_device(name)
    for refuse in (lambda: TrainConfig(device=name), lambda: RunSettings(device=name),
                   lambda: resolve_device(name)):
        with pytest.raises(ConfigError) as error:
            refuse()
        assert str(error.value) == str(expected.value)
