"""pretrain_gpt.py under torchrun with tensor, pipeline and data parallelism: the same log
as one process, iteration for iteration."""

import os
import subprocess
import sys

import pytest

from megalite.spawn import torchrun_launcher
from megalite.training_log import parse_log, parse_validation_line

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
FLAGS = flags_with("--group-query-attention", "--num-query-groups", "2", "--swiglu",
                   "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
                   "--position-embedding-type", "rope", "--attention-dropout", "0",
                   "--hidden-dropout", "0", "--log-interval", "1", "--eval-interval", "3",
                   "--eval-iters", "1", "--num-workers", "0", "--distributed-backend", "gloo",
                   vocab_size=61, make_vocab_size_divisible_by=1, num_layers=4,
                   micro_batch_size=2, global_batch_size=4, train_iters=6, lr="3e-3")


def run(prefix, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*prefix, "pretrain_gpt.py", *FLAGS, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = parse_log(proc.stdout)
    losses = [log["lm_loss"] for log in logs]
    norms = [log["grad_norm"] for log in logs]
    valid = [v["loss"] for v in map(parse_validation_line, proc.stdout.splitlines()) if v]
    return losses, norms, valid


@pytest.fixture(scope="module")
def single():
    return run([sys.executable])


@pytest.mark.parametrize("nproc, layout", [
    # TP 2 with sequence parallelism; 61 is odd, so TP pads the vocabulary differently.
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # Interleaved 1F1B: 2 stages x 2 virtual chunks of one layer each.
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--pipeline-model-parallel-size", "2"]),
    # Data parallelism: each rank reads its slice of every global batch.
    (2, []),
    (4, ["--pipeline-model-parallel-size", "2"]),
    # Zero-bubble ZB-H1: each backward split into B and a deferred weight-gradient pass W.
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    # ZeRO-1, its reduce-scatter launched during backward, its all-gather waited for by
    # the next forward.
    (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
    # Context parallelism: each rank reads its chunks of every sequence; ring attention
    # with the default flags (--attention-backend auto: sdpa on the CPU, its blocks on
    # torch's fused flash kernel).
    (2, ["--context-parallel-size", "2"]),

    # FSDP2 (ZeRO-3) over DP 2 of TP 2 shards, with sequence parallelism.
    (4, ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # FSDP2 sharded over CP 2 (DP x CP), the ring on torch's fused kernels, with TP 2 + SP.
    (4, ["--use-torch-fsdp2", "--context-parallel-size", "2", "--tensor-model-parallel-size",
         "2", "--sequence-parallel"]),
])
def test_torchrun_layout_matches_one_process(single, nproc, layout):
    parallel = run(torchrun_launcher(nproc), *layout)
    assert len(single[0]) == 6 and len(single[2]) == 4
    for a, b in zip(single, parallel):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            # The log prints 7 significant digits (and grad norm 3 decimals).
            assert abs(x - y) <= max(2e-6 * abs(x), 1.5e-3 if a is single[1] else 0), (a, b)
