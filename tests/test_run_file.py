"""--yaml-cfg run files against the command line they stand for (megalite/run_file.py).

The reference for a file is the command line a user would type for it, parsed by argparse
itself: the two must give equal configs (dataclass equality). Bad files must name the file,
the line and the key."""

import json
from pathlib import Path

import pytest
import yaml

from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.training import pretrain
from megalite.validation import validate_args, validate_model_args

from tests.helpers import BASE_FLAGS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def command_line(data: dict) -> list[str]:
    """The flags a user would type for a run file's entries (groups flattened)."""
    argv = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, dict):
            argv += command_line(value)
        elif value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_grouped_file_equals_its_command_line(tmp_path):
    text = """
model:
  num-layers: 2
  hidden_size: 64
  num-attention-heads: 4
  seq-length: 32
  swiglu: true
  disable-bias-linear: true
  normalization: RMSNorm
parallelism: {tensor-model-parallel-size: 1}
data:
  mock-data: true
  vocab-size: 64
micro-batch-size: 4
global-batch-size: 8
train-iters: 10
lr: 1.0e-3
lr-decay-style: cosine
"""
    path = write(tmp_path, text)
    expected = validate_args(parse_args(command_line(yaml.safe_load(text))))
    assert validate_args(parse_args(["--yaml-cfg", path])) == expected
    assert expected.model.swiglu and not expected.model.add_bias_linear


@pytest.mark.parametrize("config", EXAMPLE_CONFIGS, ids=lambda p: p.stem)
def test_example_config_equals_its_command_line(config):
    data = yaml.safe_load(config.read_text())
    world_size, vocab = _world_size(config), ["--vocab-size", "32000"]  # data flags: the .sh's
    from_file = validate_model_args(parse_args(["--yaml-cfg", str(config), *vocab]), world_size)
    from_flags = validate_model_args(parse_args(command_line(data) + vocab), world_size)
    assert from_file == from_flags


def _world_size(config: Path) -> int:
    """The examples' comments name their GPU count: '# world size: N'."""
    for line in config.read_text().splitlines():
        if line.startswith("# world size:"):
            return int(line.split(":")[1])
    return 1


def test_command_line_overrides_the_file(tmp_path):
    path = write(tmp_path, "num-layers: 4\nlr: 0.5\nswiglu: true\n")
    args = parse_args(["--yaml-cfg", path, "--num-layers", "2", "--lr", "1e-3"])
    assert (args.num_layers, args.lr, args.swiglu) == (2, 1e-3, True)


def test_effective_config_of_a_run_reloads_to_the_same_config(tmp_path):
    argv = [*BASE_FLAGS, "--swiglu", "--disable-bias-linear", "--train-iters", "2",
            "--log-interval", "1", "--eval-iters", "0", "--save", str(tmp_path / "ckpt"),
            "--tensorboard-dir", str(tmp_path / "tb")]
    assert pretrain(argv) == 0
    expected = validate_args(parse_args(argv))
    beside_events = tmp_path / "tb" / "run_config.yaml"
    assert validate_args(parse_args(["--yaml-cfg", str(beside_events)])) == expected
    meta = json.loads((tmp_path / "ckpt" / "iter_0000002" / "metadata.json").read_text())
    in_checkpoint = write(tmp_path, meta["run_file"])
    assert validate_args(parse_args(["--yaml-cfg", in_checkpoint])) == expected


@pytest.mark.parametrize("text, message", [
    ("num-layers: 2\nnum-layrs: 3\n", r"run.yaml, line 2: unknown key 'num-layrs'.*num-layers"),
    ("model:\n  num-layers: two\n", r"run.yaml, line 2: num-layers: expected an integer, got 'two'"),
    ("lr: [1, 2]\n", r"run.yaml, line 1: lr: expected one value"),
    ("swiglu: 1\n", r"run.yaml, line 1: swiglu: expected true or false, got 1"),
    ("normalization: BatchNorm\n", r"line 1: normalization: 'BatchNorm' is not one of LayerNorm"),
    ("num-layers: 2\nnum_layers: 3\n", r"line 2: key 'num_layers' sets the same flag as line 1"),
    ("- num-layers\n", r"run.yaml, line 1: expected a mapping"),
    ("num-layers: [\n", r"run.yaml: not valid YAML"),
    ("lr: true\n", r"line 1: lr: expected a number, got True"),
    ("num-layers: true\n", r"line 1: num-layers: expected an integer, got True"),
])
def test_bad_file_names_file_line_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        parse_args(["--yaml-cfg", path])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--yaml-cfg .*nope.yaml: cannot read it"):
        parse_args(["--yaml-cfg", str(tmp_path / "nope.yaml")])


def test_bad_file_through_pretrain_exits_nonzero(tmp_path, capsys):
    path = write(tmp_path, "hidden-size: 64.5\n")
    assert pretrain([*BASE_FLAGS, "--yaml-cfg", path]) == 2
    assert "line 1: hidden-size: expected an integer" in capsys.readouterr().err
