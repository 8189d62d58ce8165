"""Checkpoints in a bucket when the store misbehaves (docs/design.md §30), against moto's S3
server behind tests/s3_fault_proxy.py, a process answering 500/503, dropping or holding
chosen requests: an upload that keeps failing stops the run naming the object, and the
previous checkpoint stays the loadable one; so does a trainer killed mid-upload; missing or
wrong credentials stop the run before it trains. (Transient faults, retried:
tests/test_object_storage_checkpoints.py saves through the proxy.)"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from megalite.checkpointing import remote
from megalite.checkpointing.storage import (TRACKER_FILENAME, checkpoint_values,
                                           find_checkpoint_to_load)
from megalite.object_storage.local_server import s3_server
from megalite.training import pretrain

from tests.helpers import fault_proxy, flags_with

pytestmark = pytest.mark.slow  # an S3 server and a proxy, each a process

ROOT = Path(__file__).resolve().parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--save-interval", "1", vocab_size=61, make_vocab_size_divisible_by=None,
                   hidden_size=32, seq_length=16, micro_batch_size=2, global_batch_size=4,
                   train_iters=2, lr="3e-3")
MODEL, OPTIM, RNG = "model_tp00_pp000.pt", "optim_tp00_pp000_dp000.pt", "rng_rank00000.pt"


def run(capsys, *flags) -> tuple[int, str, str]:
    code = pretrain([*FLAGS, *flags])
    out, err = capsys.readouterr()
    return code, out, err


def assert_loadable_at(url: str, iteration: int, cache: Path):
    """The tracker names `iteration`, and its checkpoint downloads whole (every file's
    recorded CRC-32, then its zip records' CRC-32s)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    tracker = boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/{TRACKER_FILENAME}")
    assert tracker["Body"].read() == str(iteration).encode()
    found, directory = find_checkpoint_to_load(remote.fetch(url, str(cache)))
    assert found == iteration
    assert checkpoint_values(directory)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_upload_that_keeps_failing_names_the_object_and_keeps_the_last_checkpoint(
        tmp_path, s3_bucket, s3_server_env, monkeypatch, capsys, mode):
    url = f"{s3_bucket}/run"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # one retry, then the error
    with fault_proxy(s3_server_env["AWS_ENDPOINT_URL"], f"PUT:iter_0000002/{OPTIM}:503:*",
                     log=tmp_path / "faults.log") as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        async_save = ["--async-save"] if mode == "async" else []
        code, out, err = run(capsys, "--save", url, "--object-storage-cache-path",
                             str(tmp_path / "cache"), *async_save)
    assert code == 1 and "iteration        2/" in out
    assert f"cannot upload to {url}/iter_0000002/{OPTIM}" in err and "SlowDown" in err
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server_env["AWS_ENDPOINT_URL"])
    assert_loadable_at(url, 1, tmp_path / "fetched")


def test_a_trainer_killed_mid_upload_leaves_the_last_complete_checkpoint(tmp_path, s3_bucket,
                                                                        s3_server_env):
    url, log = f"{s3_bucket}/run", tmp_path / "faults.log"
    with fault_proxy(s3_server_env["AWS_ENDPOINT_URL"], f"PUT:iter_0000002/{OPTIM}:hang:1",
                     log=log) as endpoint:
        env = dict(os.environ, OMP_NUM_THREADS="1", AWS_ENDPOINT_URL=endpoint)
        trainer = subprocess.Popen([sys.executable, "pretrain_gpt.py", *FLAGS, "--save", url,
                                    "--object-storage-cache-path", str(tmp_path / "cache")],
                                   cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text()):  # the upload of iteration 2 is held
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert_loadable_at(url, 1, tmp_path / "fetched")


@pytest.mark.parametrize("credentials", ["missing", "wrong"])
def test_missing_or_wrong_credentials_stop_the_run_before_training(tmp_path, s3_bucket,
                                                                   monkeypatch, capsys,
                                                                   credentials):
    url = f"{s3_bucket}/run"
    with contextlib.ExitStack() as stack:
        if credentials == "missing":
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE",
                         "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                         "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
                monkeypatch.delenv(name, raising=False)
            for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
                monkeypatch.setenv(name, str(tmp_path / "none"))
            monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
            hint = "no credentials"
        else:  # a server that checks them, and knows none
            env = stack.enter_context(s3_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}))
            monkeypatch.setenv("AWS_ENDPOINT_URL", env["AWS_ENDPOINT_URL"])
            hint = "InvalidAccessKeyId"
        code, out, err = run(capsys, "--save", url)
    assert code == 2 and "iteration" not in out
    assert f"--save {url}: cannot write {url}/.megalite-write-probe-" in err and hint in err
