"""Uneven data-parallel shares without launching ranks (issue 29): the split of a global
batch's micro-batches, the sampler's slices (the same samples in the same order at any
shares), the flags' errors by name, when auto re-balances, and that its timers measure a
GPU's steps without making the host wait for it."""

import time

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import OptimizerConfig
from megalite.data.sampler import MicroBatchSampler
from megalite.data.shares import ShareBalancer, split_microbatches
from megalite.errors import ConfigError
from megalite.model.gpt import build_model_chunks
from megalite.timers import COMPUTE, Timers
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.train_step import StepRunner
from megalite.validation import validate_args

from tests.helpers import flags_with, random_batches, step_config, tiny_gpt_config


def config_of(*extra, world_size=2):
    flags = flags_with(*extra, micro_batch_size=1, global_batch_size=8)
    return validate_args(parse_args(flags), world_size)


@pytest.mark.parametrize("weights, total, unit, shares", [
    ([3, 1], 8, 1, (6, 2)), ([1, 1, 2, 4], 8, 1, (1, 1, 2, 4)),
    ([1, 1, 2, 4], 16, 1, (2, 2, 4, 8)),
    ([1, 1], 7, 1, (4, 3)),       # the spare one to the lower rank
    ([1, 100], 4, 1, (1, 3)),     # at least one each
    ([3, 1], 8, 2, (6, 2)), ([1, 1, 1], 12, 2, (4, 4, 4)), ([5, 1], 8, 2, (6, 2)),
])
def test_split_is_proportional_whole_and_at_least_one_unit(weights, total, unit, shares):
    assert split_microbatches(weights, total, unit) == shares


def test_global_batch_is_the_same_samples_in_order_at_any_shares():
    for shares in [(4, 4), (6, 2), (1, 7), (1, 1, 2, 4)]:
        dp = len(shares)
        per_rank = [list(MicroBatchSampler(24, 8, 1, r, dp, 8, shares)) for r in range(dp)]
        for step in range(2):  # global batches 1 and 2 (8 consumed)
            got = [i for r in range(dp)
                   for mb in per_rank[r][step * shares[r]:(step + 1) * shares[r]] for i in mb]
            assert got == list(range(8 + 8 * step, 16 + 8 * step)), shares


def test_flags_reach_the_config():
    t = config_of("--data-parallel-shares", "3,1").training
    assert t.data_parallel_shares == (6, 2) and t.num_microbatches == 6
    t = config_of("--data-parallel-shares", "auto", "--data-parallel-shares-threshold", "0.1",
                  world_size=4).training
    assert t.data_parallel_shares == (2, 2, 2, 2) and t.data_parallel_shares_auto
    assert t.data_parallel_shares_threshold == 0.1
    # 8 micro-batches need not divide over 3 ranks with shares
    assert config_of("--data-parallel-shares", "auto", world_size=3).training \
        .data_parallel_shares == (3, 3, 2)


@pytest.mark.parametrize("extra, world, words", [
    (["--data-parallel-shares", "3,1"], 1, ["--data-parallel-shares=3,1",
                                             "data-parallel size >= 2, got 1"]),
    (["--data-parallel-shares", "3,1,1"], 2, ["--data-parallel-shares=3,1,1",
                                               "3 weights for data-parallel size 2"]),
    (["--data-parallel-shares", "fast"], 2, ["'auto' or comma-separated weights"]),
    (["--data-parallel-shares", "auto", "--use-torch-fsdp2"], 2,
     ["--data-parallel-shares=auto", "--use-torch-fsdp2"]),
    (["--data-parallel-shares", "3,-1"], 2, ["must be positive"]),
    (["--data-parallel-shares", "auto", "--data-parallel-shares-threshold", "0"], 2,
     ["--data-parallel-shares-threshold must be > 0"]),
    (["--data-parallel-shares", "1,1,1,1,1,1,1,1,1"], 9, ["8 micro-batches", "9"]),
    (["--data-parallel-shares", "3,1", "--pipeline-model-parallel-size", "2", "--num-layers",
      "4", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "2"], 4,
     ["2 micro-batches", "multiple of 2"]),
])
def test_bad_shares_name_the_flags(extra, world, words):
    with pytest.raises(ConfigError) as err:
        config_of(*extra, world_size=world)
    for word in words:
        assert word in str(err.value), str(err.value)


class ScriptedSpeeds(ShareBalancer):
    """The balancer with the all-gather replaced by scripted speeds per window."""

    def __init__(self, speeds, **kw):
        super().__init__((4, 4), ParallelState(RankGrid(2), 0, make_groups=False), Timers(),
                         auto=True, **kw)
        self.script = iter(speeds)

    def _gather_speeds(self):
        return next(self.script)


def test_auto_balances_after_each_window_and_only_past_the_threshold():
    b = ScriptedSpeeds([[3.0, 1.0], [3.3, 1.0], [1.0, 1.0]], threshold=0.2, window=2)
    changed = [b.after_step(i) for i in range(1, 8)]
    # Step 1 is skipped; windows end at steps 3, 5, 7.
    assert changed == [False, False, True, False, False, False, True]
    assert b.shares == (4, 4) and b.speeds == [1.0, 1.0]
    assert "[4, 4]" in b.describe() and "[1.0, 1.0]" in b.describe()


class CountedEvent:
    """torch.Event on a GPU, timed by the host clock, counting the events made and the
    host's waits for one."""
    made = waits = 0

    def __init__(self, device=None, enable_timing=False):
        assert enable_timing
        CountedEvent.made += 1

    def record(self):
        self.seconds = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self):
        CountedEvent.waits += 1

    def elapsed_time(self, end) -> float:
        return (end.seconds - self.seconds) * 1e3


class TwoReplicas(ShareBalancer):
    """DP rank 0 of two replicas, the other 3x slower than this one's measured speed (the
    all-gather replaced)."""

    def _gather_speeds(self):
        mine = self._microbatches / self._seconds
        return [mine, mine / 3]


def test_auto_times_a_gpu_with_events_and_no_wait_per_micro_batch(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: syncs.append(a))
    monkeypatch.setattr(torch, "Event", CountedEvent)
    # The timers believe they time a GPU; the model runs on the CPU.
    timers = Timers(0, torch.device("cuda", 0), extra=COMPUTE)
    config = tiny_gpt_config()
    chunks = build_model_chunks(config, 3)
    runner = StepRunner(chunks, Optimizer(chunks, OptimizerConfig(lr=1e-3)),
                        step_config(config, 2, 4), ParallelState.single_process(),
                        torch.device("cpu"), timers=timers)
    balancer = TwoReplicas((4, 4), ParallelState(RankGrid(2), 0, make_groups=False), timers,
                           auto=True, threshold=0.2, window=1)
    generator = torch.Generator().manual_seed(0)
    for iteration in (1, 2):
        balancer.before_step()
        made, waits = CountedEvent.made, CountedEvent.waits
        runner.train_step(random_batches(generator, 64, 2, 8, balancer.local))
        # The host waited for neither the device nor an event; the timers recorded one at
        # each start and stop of each micro-batch's forward and backward.
        assert not syncs and CountedEvent.waits == waits
        assert CountedEvent.made - made == 4 * balancer.local
        changed = balancer.after_step(iteration)
    # Step 2's compute, read from the events, set the shares: 3:1 of 8 micro-batches.
    assert changed and balancer.shares == (6, 2)
    assert 0 < balancer.measured[0] < float("inf")
