"""--wandb-project / --wandb-exp-name / --wandb-save-dir (issue 31): a run in wandb's offline
mode, its .wandb file read back record by record, holds every scalar TensorBoard got (same
tag, step and float32 value) and the run's effective config."""

import glob
import json
import struct
import sys

import numpy as np
import pytest

from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.training import pretrain
from megalite.validation import validate_args

from tests.helpers import flags_with

WANDB = ["--wandb-project", "megalite-test", "--wandb-exp-name", "tiny"]


def wandb_records(path):
    """The protobuf Records of a .wandb file: a 7-byte header (":W&B", 0xBEE1, version),
    then LevelDB-log chunks in 32 KiB blocks: crc32 (4), length (2), type (1: full,
    2: first, 3: middle, 4: last); a block's tail shorter than a chunk header is padding."""
    from wandb.proto import wandb_internal_pb2

    block, data = 32768, open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def items(update):
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in update}


def tensorboard_scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(directory))
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"]
            for e in events.Scalars(tag)}


@pytest.mark.slow  # wandb starts its service process
def test_offline_run_holds_the_tensorboard_scalars_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="pip install -e .[wandb]")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert pretrain(flags_with(
        "--tensorboard-dir", str(tmp_path / "tb"), "--log-interval", "2", "--eval-interval",
        "2", "--eval-iters", "1", *WANDB, "--wandb-save-dir", str(tmp_path / "wb"),
        train_iters=4)) == 0
    [path] = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = list(wandb_records(path))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("megalite-test", "tiny")
    config = items(run.config.update)
    assert config["model"]["num_layers"] == 2 and config["model"]["hidden_size"] == 64
    assert config["training"]["global_batch_size"] == 8
    assert config["training"]["num_microbatches"] == 2  # derived: 8 / (4 x DP 1)
    assert config["logging"]["wandb_exp_name"] == "tiny"
    logged = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            values = items(record.history.item)
            step = values.pop("_step")
            logged.update({(tag, step): v for tag, v in values.items()
                           if not tag.startswith("_")})
    expected = tensorboard_scalars(tmp_path / "tb")
    assert {"lm loss", "lm loss validation", "learning-rate", "throughput"} <= \
        {tag for tag, _ in expected}
    assert sorted(logged) == sorted(expected)
    for key, value in expected.items():  # TensorBoard keeps float32
        assert np.float32(logged[key]) == np.float32(value), key


def test_project_needs_a_name_and_wandb(monkeypatch):
    with pytest.raises(ConfigError, match="--wandb-exp-name is required"):
        validate_args(parse_args(flags_with("--wandb-project", "p")))
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match=r"pip install -e \.\[wandb\]"):
        validate_args(parse_args(flags_with(*WANDB)))
