"""Checkpoints of a context-parallel run under torchrun (docs/design.md §8, §10): CP 2 with ZeRO-1
(optimizer state sharded over DP x CP, here the two CP ranks) resumes bit-exactly at its own
layout, and its checkpoint loads at CP 1, at another CP layout and at CP 2 under FSDP2,
continuing with the loss the saving run logged."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megalite.checkpointing.storage import TRACKER_FILENAME
from megalite.spawn import torchrun_command
from megalite.training_log import parse_log

from tests.helpers import assert_identical, checkpoint_tensors, flags_with, scalars

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
                   "--num-workers", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
                   # The ring's block kernel; the other layouts run it too, for the same
                   # round-off.
                   "--attention-backend", "unfused", "--distributed-backend", "gloo",
                   vocab_size=61, make_vocab_size_divisible_by=None, num_layers=4,
                   micro_batch_size=1, train_iters=None, lr="3e-3")
CP2_ZERO = ["--context-parallel-size", "2", "--use-distributed-optimizer"]


def run(nproc: int, *flags) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun_command(nproc, "pretrain_gpt.py", [*FLAGS, *flags]), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def losses(stdout: str) -> dict[int, float]:
    return {log["iteration"]: log["lm_loss"] for log in parse_log(stdout)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """CP 2 with ZeRO-1, 3 iterations, checkpoints at 2 and 3: (save directory,
    TensorBoard directory, the losses it logged)."""
    tmp = tmp_path_factory.mktemp("cp_saved")
    out = run(2, *CP2_ZERO, "--train-iters", "3", "--save", str(tmp / "ckpt"),
              "--save-interval", "2", "--tensorboard-dir", str(tmp / "tb"))
    return tmp / "ckpt", tmp / "tb", losses(out)


def iteration_2(saved_dir: Path, target: Path) -> Path:
    """A copy of iteration 2 alone, so a run's own saves cannot disturb the fixture."""
    target.mkdir()
    shutil.copytree(saved_dir / "iter_0000002", target / "iter_0000002")
    (target / TRACKER_FILENAME).write_text("2")
    return target


def test_resume_at_the_same_layout_is_bit_exact(saved, tmp_path):
    ckpt, tensorboard, _ = saved
    resumed = iteration_2(ckpt, tmp_path / "ckpt")
    run(2, *CP2_ZERO, "--train-iters", "3", "--save", str(resumed), "--load", str(resumed),
        "--tensorboard-dir", str(tmp_path / "tb"))
    straight, second = scalars(tensorboard), scalars(tmp_path / "tb")
    for tag in straight:
        assert sorted(second[tag]) == [3]
        assert straight[tag][3] == second[tag][3], tag
    assert_identical(checkpoint_tensors(ckpt), checkpoint_tensors(resumed))


@pytest.mark.parametrize("nproc, layout, same_grid", [
    (1, [], False),  # one process, CP 1, plain AdamW reading the DP x CP shards of ZeRO-1
    # CP 2 x DP 2 without ZeRO-1, all-gathered K/V
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"], False),
    # CP 2 with FSDP2 ZeRO-3, its shards over DP x CP (here the two CP ranks): the same
    # rank grid, so each rank's RNG state is restored
    (2, ["--context-parallel-size", "2", "--use-torch-fsdp2"], True),
])
def test_checkpoint_loads_at_another_layout(saved, tmp_path, nproc, layout, same_grid):
    ckpt, _, logged = saved
    target = iteration_2(ckpt, tmp_path / "ckpt")
    out = run(nproc, *layout, "--train-iters", "3", "--load", str(target))
    assert ("not restoring RNG states" in out) != same_grid
    loss = losses(out)[3]
    assert abs(loss - logged[3]) <= 2e-6 * logged[3], (loss, logged[3])
