"""Monitoring across ranks (issue 17): --log-straggler names a rank made slow on purpose
(2 and 4 ranks), the DP replica hash check passes on healthy runs (ZeRO-1 too) and stops
naming the rank whose parameter was perturbed, timers gathered from every rank, and a
profile written for the requested rank only, with its collectives."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel
from megalite.monitoring.replica_check import ReplicaMismatchError, check_replicas
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed, torchrun_command
from megalite.train_step import StepRunner
from megalite.training_log import parse_log

from tests.helpers import flags_with, step_config, tiny_gpt_config

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent.parent
FLAGS = flags_with("--log-interval", "2", "--eval-iters", "0", "--num-workers", "0",
                   "--distributed-backend", "gloo", "--log-straggler", vocab_size=61,
                   make_vocab_size_divisible_by=None, hidden_size=32, seq_length=16,
                   micro_batch_size=2, train_iters=4)
STRAGGLER = re.compile(r"slowest rank (\d+) \((\S+)\) ([\d.]+) ms \| fastest rank (\d+) "
                       r"\((\S+)\) ([\d.]+) ms \| slowest/fastest: ([\d.]+)")


def run_with_slow_rank(nproc: int, slow_rank: int, *flags) -> str:
    # The wrapper runs from tests/distributed/: megalite comes from the checkout.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGALITE_TEST_SLOW_RANK=str(slow_rank),
               MEGALITE_TEST_SLOW_SECONDS="0.15", PYTHONPATH=path)
    proc = subprocess.run(torchrun_command(nproc, "tests/distributed/slow_rank_pretrain.py",
                                           [*FLAGS, *flags]), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def assert_names_the_straggler(out: str, slow_rank: int):
    lines = STRAGGLER.findall(out)
    assert len(lines) == 2, out  # one per log interval
    for slowest, _, slow_ms, fastest, _, fast_ms, ratio in lines:
        assert int(slowest) == slow_rank and int(fastest) != slow_rank
        # 2 forwards per step, each 150 ms late.
        assert float(slow_ms) - float(fast_ms) >= 0.8 * 300
        # The ratio is of the unrounded times: bound it by the printed ones +- 0.05 ms
        # (a fast rank's few ms make that rounding worth a few percent).
        slow, fast = float(slow_ms), float(fast_ms)
        low, high = (slow - 0.05) / (fast + 0.05), (slow + 0.05) / max(fast - 0.05, 1e-9)
        assert low - 0.005 <= float(ratio) <= high + 0.005, (slow, fast, ratio)


def test_two_ranks_zero1_straggler_hash_check_timers_and_profile(tmp_path):
    out = run_with_slow_rank(
        2, 1, "--use-distributed-optimizer", "--check-weight-hash-across-dp-replicas-interval",
        "1", "--timing-log-level", "1", "--timing-log-option", "all", "--profile",
        "--profile-ranks", "1", "--profile-step-start", "1", "--profile-step-end", "2",
        "--profile-dir", str(tmp_path))
    assert_names_the_straggler(out, 1)
    assert len(parse_log(out)) == 2
    # Every rank's time for the ZeRO-1 parameter all-gather.
    assert re.search(r"  params-all-gather:\n     rank  0: [\d.]+\n     rank  1: [\d.]+", out)
    assert [p.name for p in tmp_path.iterdir()] == ["rank1.iter2-2.pt.trace.json"]
    with open(tmp_path / "rank1.iter2-2.pt.trace.json") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    # ZeRO-1's collectives: the gradient reduce-scatter, the parameter all-gather.
    assert {"forward-compute", "backward-compute", "all-grads-sync", "params-all-gather",
            "c10d::_reduce_scatter_base_", "gloo:all_gather"} <= names, sorted(map(str, names))


def test_four_ranks_pipeline_straggler_and_hash_check():
    out = run_with_slow_rank(4, 2, "--pipeline-model-parallel-size", "2",
                             "--check-weight-hash-across-dp-replicas-interval", "2",
                             "--timing-log-level", "2")
    assert_names_the_straggler(out, 2)
    for name in ("pipeline-send-recv", "pipeline-send-wait", "embedding-grads-all-reduce",
                 "forward-compute"):
        assert re.search(rf"^    {name} \.+: \([\d.]+, [\d.]+\)$", out, re.M), name


CONFIG = tiny_gpt_config()


def perturbed_replica(rank, world_size):
    return [_perturb_and_check(rank, world_size, zero) for zero in (False, True)]


def _perturb_and_check(rank, world_size, zero):
    state = ParallelState(RankGrid(world_size), rank)
    model = GPTModel(CONFIG, seed=1)
    buffer = GradBuffer(list(model.parameters()), state.dp_group, 10 ** 9, shard=zero)
    config = OptimizerConfig(lr=1e-3)
    optimizer = (MixedPrecisionOptimizer(model, config, None, state.tp_group, state.mp_group,
                                         buffer) if zero else Optimizer(model, config))
    runner = StepRunner(torch.nn.ModuleList([model]), optimizer, step_config(CONFIG, 2), state,
                        torch.device("cpu"), buffer)
    generator = torch.Generator().manual_seed(rank)  # each rank its own slice of the batch
    batch = {"tokens": torch.randint(0, 64, (2, 8), generator=generator),
             "labels": torch.randint(0, 64, (2, 8), generator=generator),
             "loss_mask": torch.ones(2, 8)}
    runner.train_step([batch])
    named = list(model.named_parameters())
    check_replicas(named, state.dp_group, 1, torch.device("cpu"))  # healthy: passes
    if rank == 1:
        with torch.no_grad():
            model.decoder.final_layernorm.weight[3] += 1e-6
    try:
        check_replicas(named, state.dp_group, 2, torch.device("cpu"))
    except ReplicaMismatchError as error:
        return str(error)
    return None


def test_perturbed_replica_stops_every_rank_naming_it():
    """Plain DP and ZeRO-1 (where the gathered parameters are what must agree)."""
    for message in sum(run_distributed(2, perturbed_replica), []):
        assert message is not None and message.startswith("iteration 2:")
        assert "rank(s) [1] hold other values than rank 0" in message
        assert "decoder.final_layernorm.weight" in message
