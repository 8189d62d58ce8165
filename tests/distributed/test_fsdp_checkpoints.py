"""FSDP2 checkpoints are megalite's one format (docs/design.md §8): an FSDP2 run resumes bit for
bit at its own layout, and FSDP2 -> ZeRO-1 -> FSDP2 hand a run on across layouts and
sharding strategies with the losses of the uninterrupted run; FSDP2 and ZeRO-1 with
--optimizer-cpu-offload save and log their statistics without giving a collective a host
tensor (gloo refusing them as NCCL does). One launch of 4 ranks runs every training through
megalite.training.run_training, as pretrain_gpt.py does."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

import megalite.checkpointing.saver
from megalite.arguments import parse_args
from megalite.monitoring.monitor import Monitor
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState
from megalite.spawn import run_distributed
from megalite.training import run_training
from megalite.training_log import parse_log
from megalite.validation import validate_args

from tests.distributed.nccl_like import host_tensors_refused
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
ZERO1_TP2 = ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
             "--sequence-parallel"]
STATISTICS = ["--log-params-norm", "--log-num-zeros-in-grad"]
LOGGED = ("lm_loss", "grad_norm", "num_zeros", "params_norm")
# Where every collective works on what --optimizer-cpu-offload keeps on the host.
OFFLOAD_WINDOWS = {"step": (Optimizer, "step"), "statistics": (Monitor, "statistics"),
                   "save": (megalite.checkpointing.saver, "save_checkpoint")}
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def train(rank, world_size, *flags, fields=("lm_loss", "grad_norm")) -> dict[int, tuple]:
    """One pretrain_gpt.py run in this process group; the last rank's logged `fields`
    (training_log.parse_log_line's names) per iteration."""
    config = validate_args(parse_args([*FLAGS, *flags]), world_size)
    state = ParallelState(config.parallel.grid, rank)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_training(config, state, torch.device("cpu"), None)
    dist.barrier()
    return {log["iteration"]: tuple(log[f] for f in fields)
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
    runs["plain"] = train(rank, world_size, *NO_DROPOUT, *STATISTICS, "--train-iters", "3",
                          fields=LOGGED)
    chain = f"{root}/chain"
    runs["fsdp"] = train(rank, world_size, *FSDP_TP2, *NO_DROPOUT, "--train-iters", "1",
                         "--save", chain)
    runs["zero1"] = train(rank, world_size, *ZERO1_PP2, *NO_DROPOUT, "--train-iters", "2",
                          "--save", chain, "--load", chain)
    runs["fsdp again"] = train(rank, world_size, *FSDP_ZERO2_DP4, *NO_DROPOUT,
                               "--train-iters", "3", "--load", chain)
    # The state on the host, TP 2 x DP 2, over a gloo that refuses host tensors as NCCL.
    with host_tensors_refused(OFFLOAD_WINDOWS) as check:
        for name, flags in (("fsdp offload", FSDP_TP2), ("zero1 offload", ZERO1_TP2)):
            runs[name] = train(rank, world_size, *flags, *NO_DROPOUT, *STATISTICS,
                               "--optimizer-cpu-offload", "--train-iters", "2",
                               "--save", f"{root}/{name}", fields=LOGGED)
    runs["host tensors"] = check.refused, check.checked
    return runs


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """(checkpoint root, each rank's runs) of the one launch the tests below share."""
    root = tmp_path_factory.mktemp("fsdp_checkpoints")
    return root, run_distributed(4, checkpoint_runs, str(root), timeout=600)


def test_fsdp_checkpoints_resume_exactly_and_load_across_layouts(launch):
    tmp_path, results = launch
    runs = results[-1]
    assert sorted(runs["straight"]) == [1, 2]
    assert runs["straight"] == {**runs["first half"], **runs["second half"]}
    assert sorted(runs["second half"]) == [2]
    assert_identical(checkpoint_tensors(tmp_path / "straight"),
                     checkpoint_tensors(tmp_path / "resumed"))
    chained = {**runs["fsdp"], **runs["zero1"], **runs["fsdp again"]}
    assert sorted(chained) == sorted(runs["plain"]) == [1, 2, 3]
    assert [sorted(runs[k]) for k in ("fsdp", "zero1", "fsdp again")] == [[1], [2], [3]]
    for it, (loss, *_) in runs["plain"].items():
        # The log prints 7 significant digits.
        assert abs(float(chained[it][0]) - float(loss)) <= 2e-6 * float(loss), (it, chained)


def test_offloaded_state_reaches_no_collective_on_the_host(launch):
    """FSDP2 and ZeRO-1 with --optimizer-cpu-offload at TP 2 x DP 2: --save (FSDP2 gathers
    each parameter from its host shards), --log-params-norm, --log-num-zeros-in-grad and
    the step's grad norm give NCCL no host tensor (tests/distributed/nccl_like.py); the
    statistics logged are those of the plain DP 4 run, and the two checkpoints agree."""
    root, results = launch
    for rank, runs in enumerate(results):
        refused, checked = runs["host tensors"]
        assert not refused, f"rank {rank}: host tensors NCCL would refuse: {refused}"
        assert set(checked) == set(OFFLOAD_WINDOWS), checked  # each window's were seen
    runs = results[-1]
    plain = runs["plain"]
    for name in ("fsdp offload", "zero1 offload"):
        assert sorted(runs[name]) == [1, 2], runs[name]
        for it, (loss, gnorm, zeros, pnorm) in runs[name].items():
            # The log prints 7 significant digits of the loss, 3 decimals of the norms.
            assert abs(float(loss) - float(plain[it][0])) <= 2e-6 * float(loss), (name, it)
            assert abs(float(pnorm) - float(plain[it][3])) <= 2e-3, (name, it, pnorm, plain)
            assert zeros == runs["zero1 offload"][it][2], (name, it, zeros)
    fsdp, zero1 = (checkpoint_tensors(root / name) for name in ("fsdp offload", "zero1 offload"))
    params = [k for k in fsdp if k.startswith("model_")]
    assert params and params == [k for k in zero1 if k.startswith("model_")]
    for key in (k for k in params if torch.is_tensor(fsdp[k])):
        assert torch.allclose(fsdp[key], zero1[key], rtol=1e-4, atol=2e-5), key
