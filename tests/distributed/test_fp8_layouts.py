"""FP8 at tensor-, sequence-, pipeline- (zero bubble) and data-parallel (ZeRO-1, FSDP2)
layouts and with recompute against one FP8 process (docs/design.md "FP8"): the scales do
not depend on the layout, so the per-step losses, grad norms and values after each update
agree to fp32 round-off. One launch of 2 ranks for every comparison."""

import pytest
import torch

from megalite.layout_check import Tolerance, first_difference, run_layout
from megalite.spawn import run_distributed

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

# fp32 round-off (other summation orders) moves an operand across an FP8 rounding boundary
# now and then, changing that element by one FP8 step (1/8 of it in e4m3) in a later step:
# 10x the fp32 contract's bounds. A scale taken from a shard is off by far more.
FP8 = Tolerance(1e-4, 1e-3, 5e-4)

STEPS = 3
FLAGS = flags_with("--group-query-attention", "--num-query-groups", "2", "--swiglu",
                   "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                   "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
                   "--num-workers", "0", hidden_size=32, ffn_hidden_size=64, seq_length=16,
                   micro_batch_size=2, global_batch_size=4, lr="3e-3")
HYBRID = ["--fp8-format", "hybrid"]
ROWWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]
TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = {
    "tp2 recompute": (HYBRID, TP2 + ["--recompute-granularity", "full", "--recompute-method",
                                     "uniform", "--recompute-num-layers", "1"]),
    "tp2 sp": (HYBRID, TP2 + ["--sequence-parallel"]),
    "pp2 zb-h1": (HYBRID, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                           "zb-h1"]),
    "dp2 zero-1": (HYBRID, ["--use-distributed-optimizer"]),
    # The weights' FP8 copies are made once a step (fp8.quantize_weights_once): after the
    # overlapped parameter all-gather lands, and from FSDP2's gathered weights.
    "dp2 zero-1 overlapped": (HYBRID, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                       "--overlap-param-gather"]),
    "dp2 fsdp2": (HYBRID, ["--use-torch-fsdp2"]),
    "rowwise tp2 sp": (ROWWISE, TP2 + ["--sequence-parallel"]),
}


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    # Each rank runs the one-process references itself (rank 0 of a world of one).
    references = {tuple(fp8): run_layout(FLAGS + fp8, 1, 0, cpu, STEPS)
                  for fp8 in (HYBRID, ROWWISE)}
    plain = run_layout(FLAGS, 1, 0, cpu, STEPS)
    differences = {"fp8 differs from the plain model": None if
                   references[tuple(HYBRID)].steps != plain.steps else "no: same steps"}
    for name, (fp8, layout) in LAYOUTS.items():
        run = run_layout(FLAGS + fp8 + layout, world_size, rank, cpu, STEPS)
        differences[name] = first_difference(run, references[tuple(fp8)], FP8)
    return differences


def test_fp8_layouts_match_one_fp8_process():
    failures = [f"rank {rank}, {name}: {difference}"
                for rank, differences in enumerate(run_distributed(2, _compare, timeout=300))
                for name, difference in differences.items() if difference is not None]
    assert not failures, "\n".join(failures)
