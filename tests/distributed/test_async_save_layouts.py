"""--async-save at TP 2 x PP 2 x DP 2 with ZeRO-1 and with FSDP2 (docs/design.md §16): every
rank's files byte for byte those of a synchronous save of the same state, a run resumed
from the asynchronous checkpoint writes the uninterrupted run's next checkpoint byte for
byte, and each rank's host buffers hold the tensors of the files it writes, no more (under
FSDP2 every DP rank gathers each parameter, one writes it). ZeRO-1's asynchronous saves go
to moto's S3 server (tests/conftest.py) and the run resumed from there saves into it
synchronously: the objects are the local files' bytes (docs/design.md §30); and the bucket's
checkpoint resumed at TP 4 x PP 2 writes what the same checkpoint on disk resumed there
writes. One launch of 8 ranks runs every training through megalite.training.run_training."""

import os

import pytest

from megalite.checkpointing import async_save
from megalite.spawn import run_distributed

from tests.helpers import (assert_same_files, download_objects, flags_with, saved_files,
                           tensor_bytes, train_in_rank)

pytestmark = pytest.mark.slow  # launches processes

FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--distributed-backend", "gloo", "--attention-dropout", "0.1",
                   "--hidden-dropout", "0.1", "--save-interval", "1",
                   "--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--pipeline-model-parallel-size", "2", vocab_size=61,
                   make_vocab_size_divisible_by=1, num_layers=4, hidden_size=32, seq_length=16,
                   micro_batch_size=1, global_batch_size=4, train_iters=None, lr="3e-3")
LAYOUTS = {"zero1": ["--use-distributed-optimizer"], "fsdp2": ["--use-torch-fsdp2"]}
OTHER_LAYOUT = ["--tensor-model-parallel-size", "4"]  # TP 4 x PP 2, no ZeRO-1


def train(rank, world_size, *flags) -> str:
    return train_in_rank(rank, world_size, [*FLAGS, *flags])


def record_snapshots(held: list) -> None:
    """This rank's async saves append (the bytes of its host buffers, the files it
    writes) to `held`."""
    rank_files = async_save.rank_files

    def recording(*args):
        files = rank_files(*args)
        held.append((args[1].__self__.nbytes, sorted(files)))  # args[1]: HostBuffers.copy
        return files
    async_save.rank_files = recording


def runs(rank, world_size, root, bucket, env):
    """Per layout: sync 2 steps (saves 1, 2); async 1 step; resumed from it to 2 (ZeRO-1's:
    into and from the S3 server's `bucket`, the resumed save synchronous). Then the
    bucket's ZeRO-1 iteration 2 and the same checkpoint on disk, each resumed at TP 4 x PP 2
    for a step. Returns what each resumed run printed and what the async saves held."""
    os.environ.update(env)  # the ranks' environment is the forkserver's
    printed, held = {}, {}
    snapshots = []
    record_snapshots(snapshots)
    cache = ["--object-storage-cache-path", f"{root}/cache"]
    for name, layout in LAYOUTS.items():
        sync, asyn = f"{root}/{name}_sync", f"{root}/{name}_async"
        resumed = ["--async-save"]
        if name == "zero1":
            asyn, resumed = f"{bucket}/{name}_async", cache
        train(rank, world_size, *layout, "--train-iters", "2", "--save", sync)
        train(rank, world_size, *layout, "--train-iters", "1", "--save", asyn, "--async-save",
              *cache)
        printed[name] = train(rank, world_size, *layout, "--train-iters", "2", "--save", asyn,
                              "--load", asyn, *resumed)
        held[name] = snapshots[-1]
    for name, load in (("other_bucket", f"{bucket}/zero1_async"),
                       ("other_disk", f"{root}/zero1_sync")):
        printed[name] = train(rank, world_size, *OTHER_LAYOUT, "--train-iters", "3", "--load",
                              load, "--save", f"{root}/{name}", *cache)
    return printed, held


def test_async_save_bytes_and_resume_at_tp2_pp2_dp2(tmp_path, s3_bucket, s3_server_env):
    results = run_distributed(8, runs, str(tmp_path), s3_bucket, s3_server_env, timeout=600)
    printed = results[0][0]
    saved = {"zero1_async": download_objects(f"{s3_bucket}/zero1_async", tmp_path / "bucket"),
             "fsdp2_async": tmp_path / "fsdp2_async"}
    for name in LAYOUTS:
        assert "resuming from" in printed[name] and "at iteration 1" in printed[name], name
        for iteration in (1, 2):
            directory = f"iter_{iteration:07d}"
            assert_same_files(tmp_path / f"{name}_sync" / directory,
                              saved[f"{name}_async"] / directory)
        # ZeRO-1's last async save is iteration 1's (its resumed save is synchronous).
        last = saved[f"{name}_async"] / ("iter_0000001" if name == "zero1" else "iter_0000002")
        for rank, (_, held) in enumerate(results):
            nbytes, names = held[name]
            assert nbytes == tensor_bytes(saved_files(last, names)), (name, rank)
    assert f"resuming from {s3_bucket}/zero1_async at iteration 2" in printed["other_bucket"]
    assert "not restoring RNG states" in printed["other_bucket"]
    assert_same_files(tmp_path / "other_disk" / "iter_0000003",
                      tmp_path / "other_bucket" / "iter_0000003")
