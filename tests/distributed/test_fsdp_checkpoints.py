"""FSDP2 checkpoints are megalite's one format (docs/design.md §8): an FSDP2 run resumes bit for
bit at its own layout, and FSDP2 -> ZeRO-1 -> FSDP2 hand a run on across layouts and
sharding strategies with the losses of the uninterrupted run. One launch of 4 ranks runs
every training through megalite.training.run_training, as pretrain_gpt.py does."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.parallel_state import ParallelState
from megalite.spawn import run_distributed
from megalite.training import run_training
from megalite.training_log import parse_log
from megalite.validation import validate_args

from tests.helpers import assert_identical, checkpoint_tensors, flags_with

pytestmark = pytest.mark.slow  # every test here launches processes

FLAGS = flags_with("--lr-decay-iters", "3", "--log-interval", "1", "--eval-iters", "0",
                   "--num-workers", "0", "--distributed-backend", "gloo", vocab_size=61,
                   make_vocab_size_divisible_by=1, num_layers=4, hidden_size=32, seq_length=16,
                   micro_batch_size=1, train_iters=None, lr="3e-3")
FSDP_TP2 = ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
ZERO1_PP2 = ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "1"]
FSDP_ZERO2_DP4 = ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def train(rank, world_size, *flags) -> dict[int, tuple[str, str]]:
    """One pretrain_gpt.py run in this process group; the last rank's logged
    (loss, grad norm) per iteration."""
    config = validate_args(parse_args([*FLAGS, *flags]), world_size)
    state = ParallelState(config.parallel.grid, rank)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_training(config, state, torch.device("cpu"), None)
    dist.barrier()
    return {log["iteration"]: (log["lm_loss"], log["grad_norm"])
            for log in parse_log(out.getvalue())}


def checkpoint_runs(rank, world_size, root):
    runs = {}
    # Same layout, dropout on: 2 steps straight against 1, save, load (new model and
    # optimizer, RNG from the checkpoint), 1 more.
    common = [*FSDP_TP2, *DROPOUT, "--train-iters", "2"]
    runs["straight"] = train(rank, world_size, *common, "--save", f"{root}/straight")
    runs["first half"] = train(rank, world_size, *common, "--save", f"{root}/resumed",
                               "--exit-interval", "1")
    runs["second half"] = train(rank, world_size, *common, "--save", f"{root}/resumed",
                                "--load", f"{root}/resumed")
    # Across layouts and strategies, dropout off: FSDP2 ZeRO-3 TP 2 x DP 2 -> ZeRO-1
    # PP 2 (v=2) x DP 2 -> FSDP2 ZeRO-2 DP 4, against plain DP 4 straight.
    runs["plain"] = train(rank, world_size, *NO_DROPOUT, "--train-iters", "3")
    chain = f"{root}/chain"
    runs["fsdp"] = train(rank, world_size, *FSDP_TP2, *NO_DROPOUT, "--train-iters", "1",
                         "--save", chain)
    runs["zero1"] = train(rank, world_size, *ZERO1_PP2, *NO_DROPOUT, "--train-iters", "2",
                          "--save", chain, "--load", chain)
    runs["fsdp again"] = train(rank, world_size, *FSDP_ZERO2_DP4, *NO_DROPOUT,
                               "--train-iters", "3", "--load", chain)
    return runs


def test_fsdp_checkpoints_resume_exactly_and_load_across_layouts(tmp_path):
    runs = run_distributed(4, checkpoint_runs, str(tmp_path), timeout=600)[-1]
    assert sorted(runs["straight"]) == [1, 2]
    assert runs["straight"] == {**runs["first half"], **runs["second half"]}
    assert sorted(runs["second half"]) == [2]
    assert_identical(checkpoint_tensors(tmp_path / "straight"),
                     checkpoint_tensors(tmp_path / "resumed"))
    chained = {**runs["fsdp"], **runs["zero1"], **runs["fsdp again"]}
    assert sorted(chained) == sorted(runs["plain"]) == [1, 2, 3]
    assert [sorted(runs[k]) for k in ("fsdp", "zero1", "fsdp again")] == [[1], [2], [3]]
    for it, (loss, _) in runs["plain"].items():
        # The log prints 7 significant digits.
        assert abs(float(chained[it][0]) - float(loss)) <= 2e-6 * float(loss), (it, chained)
