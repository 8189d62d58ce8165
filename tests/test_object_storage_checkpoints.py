"""Checkpoints in a bucket, one process (docs/design.md §30), against moto's S3 server run
as a process (tests/conftest.py), some requests failed by a proxy: saved synchronously and
with --async-save, every object's bytes those of the same run's local save, resumed from the
bucket bit-exactly, retention and HF export as on disk.
tests/distributed/test_async_save_layouts.py does the same at TP 2 x PP 2 x DP 2 with ZeRO-1,
and resumes at another layout."""

import contextlib
import io

import pytest

from megalite.checkpointing.storage import TRACKER_FILENAME
from megalite.training import pretrain

from tests.helpers import (assert_identical, assert_same_files, download_objects, fault_proxy,
                           flags_with, load_tool)

pytestmark = pytest.mark.slow  # an S3 server process

FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
                   "--save-interval", "2", vocab_size=61, make_vocab_size_divisible_by=None,
                   hidden_size=32, seq_length=16, micro_batch_size=2, global_batch_size=4,
                   train_iters=4, lr="3e-3")
MODEL, OPTIM, RNG = "model_tp00_pp000.pt", "optim_tp00_pp000_dp000.pt", "rng_rank00000.pt"


def run(*flags) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pretrain([*FLAGS, *flags]) == 0
    return out.getvalue()


def test_a_run_saves_to_a_bucket_and_resumes_from_it_bit_exactly(tmp_path, s3_bucket,
                                                                 s3_server_env, monkeypatch):
    """4 steps saving locally every 2, against 2 steps saving synchronously to the bucket
    and a new run resumed from it for 2 more saving with --async-save and keeping 1, both
    through tests/s3_fault_proxy.py failing some requests once or twice (throttling, 5xx, a
    dropped connection: retried): the objects of iterations 2 and 4 are the local files'
    bytes, iteration 2 is retired, and what the HF export converts from the bucket is what
    it converts from disk."""
    local, url, log = tmp_path / "local", f"{s3_bucket}/run", tmp_path / "faults.log"
    cache = ["--object-storage-cache-path", str(tmp_path / "cache")]
    faults = [f"PUT:iter_0000002/{MODEL}:503:2", f"PUT:iter_0000002/{OPTIM}:drop:1",
              f"HEAD:iter_0000002/{RNG}:500:1", f"GET:iter_0000002/{MODEL}:503:1",
              f"PUT:iter_0000004/{OPTIM}:503:1"]
    run("--save", str(local))
    with fault_proxy(s3_server_env["AWS_ENDPOINT_URL"], *faults, log=log) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        run("--save", url, "--exit-interval", "2", *cache)
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server_env["AWS_ENDPOINT_URL"])
        first = download_objects(url, tmp_path / "first")  # not through the proxy
        assert (first / TRACKER_FILENAME).read_text() == "2"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        second = run("--save", url, "--load", url, "--async-save", "--keep-last-n-checkpoints",
                     "1", *cache)
    assert len(log.read_text().splitlines()) == 6  # every fault was met
    assert f"resuming from {url} at iteration 2" in second
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server_env["AWS_ENDPOINT_URL"])
    final = download_objects(url, tmp_path / "final")
    assert sorted(p.name for p in final.iterdir()) == ["iter_0000004", TRACKER_FILENAME]
    assert (final / TRACKER_FILENAME).read_text() == "4"
    assert_same_files(local / "iter_0000002", first / "iter_0000002")
    assert_same_files(local / "iter_0000004", final / "iter_0000004")
    # What tools/convert_checkpoint.py --export-hf converts, from the bucket and from disk.
    convert = load_tool("convert_checkpoint")
    exported = [convert.full_state_dict(*convert.find_checkpoint(source, None)[1:])
                for source in (url, str(local))]
    assert exported[0][0] == exported[1][0]
    assert_identical(exported[0][1], exported[1][1])
