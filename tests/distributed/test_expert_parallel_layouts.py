"""Expert parallelism against one process (fp32, dropless, dropout 0, auxiliary and z losses
on; docs/design.md "Expert parallelism"): EP 2 and EP 4, EP 2 with TP 2 + SP, with PP 2
(ZB-H1, and interleaved), with DP 2 and ZeRO-1, with CP 2, with full recompute (the
all-to-all dispatcher), and the all-gather dispatcher: the same initial values (all experts
gathered over EP), per-step losses and grad norms, and values after each update. One launch
of 4 ranks."""

import pytest
import torch

from megalite.layout_check import first_difference, run_layout
from megalite.spawn import run_distributed

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

STEPS = 3
BASE = flags_with("--swiglu", "--disable-bias-linear", "--attention-dropout", "0",
                  "--hidden-dropout", "0", "--num-workers", "0", "--num-experts", "4",
                  "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.1",
                  "--moe-z-loss-coeff", "0.01", "--moe-grouped-gemm",
                  "--moe-token-dispatcher-type", "alltoall",
                  hidden_size=32, ffn_hidden_size=64, seq_length=16, micro_batch_size=1,
                  global_batch_size=4, lr="3e-3")
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
# name: (ranks, flags); the interleaved pipeline needs 4 layers (a reference of its own).
LAYOUTS = {
    "EP 2": (2, EP2),
    "EP 4": (4, EP4),
    "EP 2 x TP 2 + SP": (4, EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "EP 2 x DP 2, ZeRO-1": (4, EP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                      "--overlap-param-gather"]),
    "EP 2 x CP 2": (2, EP2 + ["--context-parallel-size", "2"]),
    "EP 2, all-gather dispatcher": (2, EP2 + ["--moe-token-dispatcher-type", "allgather"]),
    "EP 2, full recompute": (2, EP2 + ["--recompute-granularity", "full",
                                       "--recompute-method", "uniform"]),
    "EP 2 x PP 2 zb-h1": (4, EP2 + ["--pipeline-model-parallel-size", "2",
                                    "--pipeline-schedule", "zb-h1"]),
    "EP 2 x PP 2 interleaved": (4, EP2 + ["--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "1",
                                          "--num-layers", "4"]),
}


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    references = {layers: run_layout(BASE + ["--num-layers", layers], 1, 0, cpu, STEPS)
                  for layers in ("2", "4")}
    differences = {}
    for name, (ranks, flags) in LAYOUTS.items():
        run = run_layout(BASE + flags, ranks, rank, cpu, STEPS)
        layers = flags[flags.index("--num-layers") + 1] if "--num-layers" in flags else "2"
        difference = run and first_difference(run, references[layers])
        if difference:
            differences[name] = difference
    return differences


def test_expert_parallel_layouts_match_one_process():
    failures = dict(enumerate(run_distributed(4, _compare, timeout=300)))  # rank: layouts
    assert not any(failures.values()), failures
