"""Non-persistent (node-local) checkpoints, --non-persistent-ckpt-type local (docs/design.md
§16), at DP 2 with ZeRO-1: a run that dies after a local save newer than its last
persistent one resumes from the local save, and from the persistent one when one rank's
local file is missing or damaged (a flipped bit, which the CRC-32s of its zip records
reveal); every way it ends with the uninterrupted run's checkpoint, byte for byte. One
launch of 2 ranks."""

import shutil

import pytest
import torch

from megalite.checkpointing.local import rank_path
from megalite.checkpointing.saver import CheckpointSaver
from megalite.spawn import run_distributed

from tests.helpers import (assert_same_files, flags_with, flip_a_bit_of_the_largest_record,
                           train_in_rank)

pytestmark = pytest.mark.slow  # launches processes

FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--distributed-backend", "gloo", "--attention-dropout", "0.1",
                   "--hidden-dropout", "0.1", "--use-distributed-optimizer",
                   "--save-interval", "2", vocab_size=61, make_vocab_size_divisible_by=1,
                   hidden_size=32, seq_length=16, micro_batch_size=1, global_batch_size=4,
                   train_iters=6, lr="3e-3")


class Killed(Exception):
    pass


def train(rank, world_size, *flags) -> str:
    return train_in_rank(rank, world_size, [*FLAGS, *flags])


def die_at_persistent_save_4(rank, world_size, save, local):
    """Local saves at 1 and 3, persistent at 2; dies as the persistent save of 4 starts."""
    original = CheckpointSaver.save

    def save_or_die(self, iteration):
        if iteration == 4:
            raise Killed
        original(self, iteration)
    CheckpointSaver.save = save_or_die
    try:
        train(rank, world_size, "--save", save, "--non-persistent-save-interval", "1",
              "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", local)
    except Killed:
        pass
    finally:
        CheckpointSaver.save = original


def runs(rank, world_size, root):
    train(rank, world_size, "--save", f"{root}/straight")
    die_at_persistent_save_4(rank, world_size, f"{root}/a", f"{root}/a_local")
    if rank == 0:
        for name in ("b", "c"):
            shutil.copytree(f"{root}/a", f"{root}/{name}")
            shutil.copytree(f"{root}/a_local", f"{root}/{name}_local")
        rank_path(f"{root}/b_local", 3, 1).unlink()  # rank 1's node lost its disk
        flip_a_bit_of_the_largest_record(rank_path(f"{root}/c_local", 3, 1))  # or rotted
    torch.distributed.barrier()
    printed = {}
    for name in ("a", "b", "c"):
        printed[name] = train(rank, world_size, "--save", f"{root}/{name}", "--load",
                              f"{root}/{name}", "--non-persistent-save-interval", "1",
                              "--non-persistent-ckpt-type", "local",
                              "--non-persistent-local-ckpt-dir", f"{root}/{name}_local")
    return printed


def test_restart_prefers_a_newer_local_save_every_rank_has(tmp_path):
    printed = run_distributed(2, runs, str(tmp_path), timeout=600)[0]
    assert f"resuming from {tmp_path}/a_local at iteration 3" in printed["a"], printed["a"]
    for name in ("b", "c"):
        assert f"resuming from {tmp_path}/{name} at iteration 2" in printed[name], printed[name]
    for name in ("a", "b", "c"):
        assert_same_files(tmp_path / "straight" / "iter_0000006",
                          tmp_path / name / "iter_0000006")
        # Kept only until the next persistent save: none left after iteration 6's.
        assert not list((tmp_path / f"{name}_local").glob("iter_*/rank_*.pt")), name
