"""MoE layers at TP 2 + SP, PP 2 and DP 2 against one process (fp32, dropless or capacity
routed, dropout 0; docs/design.md "Mixture of experts"): the same initial values, per-step
losses and grad norms, and values after each update, with the auxiliary losses and the
expert bias on, whose weighting (1 / micro-batches per global batch) and counts (summed over
the global batch) must not depend on the layout. One launch of 2 ranks."""

import pytest
import torch

from megalite.layout_check import first_difference, run_layout
from megalite.spawn import run_distributed

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

STEPS = 3
BASE = flags_with("--swiglu", "--disable-bias-linear", "--attention-dropout", "0",
                  "--hidden-dropout", "0", "--num-workers", "0", "--num-experts", "4",
                  "--moe-ffn-hidden-size", "16", hidden_size=32, ffn_hidden_size=64,
                  seq_length=16, micro_batch_size=2, global_batch_size=4, lr="3e-3")
ROUTERS = {
    "softmax aux z shared grouped": ["--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff",
                                     "0.01", "--moe-shared-expert-intermediate-size", "32",
                                     "--moe-grouped-gemm"],
    "sigmoid bias seq-aux capacity": ["--moe-router-score-function", "sigmoid",
                                      "--moe-router-enable-expert-bias",
                                      "--moe-router-bias-update-rate", "0.05",
                                      "--moe-router-load-balancing-type", "seq_aux_loss",
                                      "--moe-aux-loss-coeff", "0.1",
                                      "--moe-expert-capacity-factor", "1.0",
                                      "--moe-layer-freq", "([0]*1+[1]*1)"],
}
LAYOUTS = {
    "tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": [],
    # FSDP2 builds on `meta`: the router's buffers from to_empty, on the host under offload.
    "dp2 fsdp2 offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"],
}


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    differences = {}
    for router, router_flags in ROUTERS.items():
        reference = run_layout(BASE + router_flags, 1, 0, cpu, STEPS)
        for name, layout in LAYOUTS.items():
            run = run_layout(BASE + router_flags + layout, world_size, rank, cpu, STEPS)
            differences[f"{router}, {name}"] = first_difference(run, reference)
    return differences


def test_moe_layouts_match_one_process():
    results = run_distributed(2, _compare, timeout=300)
    failures = {(rank, name): difference for rank, differences in enumerate(results)
                for name, difference in differences.items() if difference is not None}
    assert not failures, failures
