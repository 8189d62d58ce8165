"""Checkpoints under torchrun: exact resume at TP 2 x PP 2 (v=2) x DP 2 with ZeRO-1,
loading at other layouts, a signal on one rank, a killed rank restarted by torchrun, and a
NaN on one rank named in the error."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megalite.checkpointing.storage import TRACKER_FILENAME, find_checkpoint_to_load
from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.errors import NumericalError
from megalite.model.gpt import GPTModel
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed, torchrun_command, torchrun_workers
from megalite.train_step import StepRunner
from megalite.training_log import parse_log

from tests.helpers import (assert_identical, checkpoint_tensors, flags_with, scalars,
                           step_config, tiny_gpt_config)

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
                   "--num-workers", "0", "--distributed-backend", "gloo", vocab_size=61,
                   make_vocab_size_divisible_by=None, num_layers=4, micro_batch_size=1,
                   train_iters=None, lr="3e-3")
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
             "1", "--use-distributed-optimizer"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def torchrun(nproc, *flags, max_restarts=None):
    return torchrun_command(nproc, "pretrain_gpt.py", [*FLAGS, *flags], max_restarts)


def run(nproc, *flags) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun(nproc, *flags), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def losses(stdout: str) -> dict[int, str]:
    return {log["iteration"]: log["lm_loss"] for log in parse_log(stdout)}


def test_3d_zero_resume_is_bit_exact(tmp_path):
    """8 processes, dropout on: 4 steps straight (saving at 2 and 4) against its iteration-2
    checkpoint loaded by new processes + 2 steps; every loss and grad norm, and every tensor
    of the final checkpoint identical. (A single process's --exit-interval save is
    tests/test_checkpointing.py's: the same save, so one launch fewer here.)"""
    common = [*LAYOUT_3D, *DROPOUT, "--train-iters", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(8, *common, "--save", str(straight), "--save-interval", "2",
        "--tensorboard-dir", str(tmp_path / "tb1"))
    resumed.mkdir()
    shutil.copytree(straight / "iter_0000002", resumed / "iter_0000002")
    (resumed / TRACKER_FILENAME).write_text("2")
    run(8, *common, "--save", str(resumed), "--load", str(resumed),
        "--tensorboard-dir", str(tmp_path / "tb2"))
    first, second = scalars(tmp_path / "tb1"), scalars(tmp_path / "tb2")
    for tag in first:
        assert sorted(first[tag]) == [1, 2, 3, 4] and sorted(second[tag]) == [3, 4], tag
        assert {step: first[tag][step] for step in (3, 4)} == second[tag], tag
    assert_identical(checkpoint_tensors(straight), checkpoint_tensors(resumed))


@pytest.fixture(scope="module")
def saved_3d(tmp_path_factory):
    """A TP 2 x PP 2 (v=2) x DP 2 ZeRO-1 checkpoint at iteration 2, and the loss the same
    run logged at iteration 3."""
    save = tmp_path_factory.mktemp("saved_3d") / "ckpt"
    out = run(8, *LAYOUT_3D, *NO_DROPOUT, "--train-iters", "3", "--save", str(save),
              "--save-interval", "2")
    return save, float(losses(out)[3])


@pytest.mark.parametrize("nproc, layout", [
    (4, []),  # TP 1 x PP 1 x DP 4, plain optimizer
    (8, ["--tensor-model-parallel-size", "4", "--use-distributed-optimizer"]),  # TP 4 x DP 2
])
def test_checkpoint_loads_at_another_layout(saved_3d, tmp_path, nproc, layout):
    save, reference = saved_3d
    target = tmp_path / "ckpt"
    target.mkdir()
    # A copy of iteration 2 alone, so this run's own saves cannot disturb the fixture.
    subprocess.run(["cp", "-r", str(save / "iter_0000002"), str(target)], check=True)
    (target / TRACKER_FILENAME).write_text("2")
    out = run(nproc, *layout, *NO_DROPOUT, "--train-iters", "3", "--load", str(target))
    assert "not restoring RNG states" in out
    loss = float(losses(out)[3])
    assert abs(loss - reference) <= 2e-6 * reference, (loss, reference)


def _start_and_wait_for_checkpoint(save: Path, *flags, max_restarts=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(torchrun(2, *flags, max_restarts=max_restarts), cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (save / TRACKER_FILENAME).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


FAULT_RUN = ["--pipeline-model-parallel-size", "2", *DROPOUT, "--train-iters", "60",
             "--eval-iters", "0", "--save-interval", "5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    save = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    return losses(run(2, *FAULT_RUN, "--save", str(save)))[60]


def test_signal_on_one_rank_stops_all_ranks_with_a_checkpoint(tmp_path, uninterrupted):
    save = tmp_path / "ckpt"
    flags = [*FAULT_RUN, "--save", str(save), "--exit-signal-handler"]
    proc = _start_and_wait_for_checkpoint(save, *flags)
    os.kill(torchrun_workers(proc.pid)[1], signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "received signal SIGUSR1" in out
    iteration = find_checkpoint_to_load(save)[0]
    assert iteration < 60, "the run ended before the signal arrived"
    resumed = run(2, *flags, "--load", str(save))
    assert losses(resumed)[60] == uninterrupted


def test_killed_rank_restarts_and_ends_where_the_uninterrupted_run_ends(tmp_path,
                                                                        uninterrupted):
    save = tmp_path / "ckpt"
    flags = [*FAULT_RUN, "--save", str(save), "--load", str(save)]
    proc = _start_and_wait_for_checkpoint(save, *flags, max_restarts=1)
    os.kill(torchrun_workers(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resuming from" in out, "the run ended before the kill (or never restarted)"
    assert losses(out)[60] == uninterrupted
    recovery = re.search(r"recovery time: ([\d.]+) s from process start", out)
    assert recovery, out[-3000:]
    print(f"torchrun restart: recovery time {recovery[1]} s from the restarted worker's start "
          "to the end of its first iteration")


CONFIG = tiny_gpt_config()


def nan_on_rank_one(rank, world_size):
    """A NaN loss on rank 1 (a weight set to NaN), then, with ZeRO-1 and with a plain
    all-reduce, a NaN in one gradient element of rank 1 only: the message of each, and
    whether every parameter was left as it was."""
    state = ParallelState(RankGrid(world_size), rank)
    batch = {"tokens": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8)),
             "loss_mask": torch.ones(2, 8)}
    results = []
    for case in ("loss", "zero1", "all-reduce"):
        model = GPTModel(CONFIG, seed=1)
        buffer = GradBuffer(list(model.parameters()), state.dp_group, 10 ** 9,
                            shard=case == "zero1")
        optimizer = (MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-3), None, None, None,
                                             buffer) if case == "zero1"
                     else Optimizer(model, OptimizerConfig(lr=1e-3)))
        runner = StepRunner(torch.nn.ModuleList([model]), optimizer,
                            step_config(CONFIG, 2, check_for_nan=True), state,
                            torch.device("cpu"), buffer)
        runner.train_step([batch])
        if rank == 1 and case == "loss":
            with torch.no_grad():
                model.decoder.final_layernorm.weight[0] = float("nan")
        elif rank == 1:  # the last element of the first parameter: rank 0's ZeRO-1 shard
            model.embedding.word_embeddings.weight.register_hook(
                lambda grad: grad.index_put((torch.tensor(0), torch.tensor(0)),
                                            torch.tensor(float("nan"))))
        before = [p.detach().clone() for p in model.parameters()]
        try:
            runner.train_step([batch])
        except NumericalError as error:
            unchanged = all(torch.allclose(p, b, rtol=0, atol=0, equal_nan=True)
                            for p, b in zip(model.parameters(), before))
            results.append((str(error), unchanged))
            continue
        results.append((None, False))
    return results


def test_nan_on_one_rank_stops_every_rank_naming_it():
    """Named where the NaN starts: a gradient's before the data-parallel reduction mixes
    the ranks' (after it, a plain all-reduce puts the NaN on every rank, ZeRO-1's
    reduce-scatter on the rank whose shard holds the element)."""
    for results in run_distributed(2, nan_on_rank_one):
        (loss, loss_unchanged), *grads = results
        assert loss is not None and "lm loss is NaN or infinite on rank(s) [1]" in loss
        assert loss_unchanged  # no optimizer step was taken
        for message, unchanged in grads:
            assert message is not None and \
                "a gradient is NaN or infinite on rank(s) [1] before the data-parallel " \
                "reduction" in message, message
            assert unchanged
