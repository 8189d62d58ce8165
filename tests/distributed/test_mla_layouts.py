"""Multi-latent attention (docs/design.md §32) with a multi-token prediction depth (§33: an
MLA layer of its own, on the last stage) at every kind of layout against one process with the
same flags: TP 2 with and without SP (the shared RoPE key's gradient summed both
ways), selective recompute, PP 2, CP 2 on the ring (its fused blocks pad V) and on
all_gather, EP 2 (MoE), DP 2 ZeRO-1, FSDP2. A query latent, the latent norms and YaRN past its
original length (8 of 16 positions), V heads narrower than Q/K's. fp32, dropout 0: the same
initial values, per-step losses and grad norms, and values after each update. One launch of
4 ranks. tests/distributed/test_mtp_layouts.py has MTP's own pipeline cases (tied and
untied, interleaved, zb-h1, FSDP2 over PP 2 x DP 2) and its resume.

A feature that composes with MLA adds its flags to the references of REFERENCES and a layout
to LAYOUTS."""

import pytest
import torch

from megalite.layout_check import first_difference, run_layout
from megalite.spawn import run_distributed

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

STEPS = 2
MLA = ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm",
       "--rotary-scaling-factor", "4", "--mscale-all-dim", "1",
       "--yarn-original-max-position-embeddings", "8", "--mtp-num-layers", "1"]
BASE = flags_with(*MLA, "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                  "rope", "--disable-bias-linear", "--attention-dropout", "0",
                  "--hidden-dropout", "0", "--num-workers", "0", vocab_size=12, hidden_size=32,
                  ffn_hidden_size=64, num_layers=4, seq_length=16, micro_batch_size=1,
                  global_batch_size=4, lr="3e-3")
# The one-process references: name -> flags beyond BASE.
REFERENCES = {
    "query latent": ["--q-lora-rank", "16"],
    "no query latent": [],
    "query latent, MoE": ["--q-lora-rank", "16", "--num-experts", "4", "--moe-ffn-hidden-size",
                          "16", "--moe-aux-loss-coeff", "0.1", "--moe-token-dispatcher-type",
                          "alltoall"],
}
TP2 = ["--tensor-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
# name: (ranks, its reference, the layout's flags beyond the reference's)
LAYOUTS = {
    "TP 2 + SP": (2, "query latent", TP2 + ["--sequence-parallel"]),
    "TP 2, no SP, no query latent": (2, "no query latent", TP2),
    "TP 2 + SP, selective recompute": (2, "no query latent",
                                       TP2 + ["--sequence-parallel", "--recompute-granularity",
                                              "selective"]),
    "PP 2": (2, "query latent", ["--pipeline-model-parallel-size", "2"]),
    "CP 2 p2p": (2, "query latent", CP2 + ["--cp-comm-type", "p2p"]),
    "CP 2 all_gather": (2, "query latent", CP2 + ["--cp-comm-type", "all_gather"]),
    "EP 2": (2, "query latent, MoE", ["--expert-model-parallel-size", "2"]),
    "DP 2 ZeRO-1": (2, "query latent", ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                        "--overlap-param-gather"]),
    "DP 2 FSDP2": (2, "query latent", ["--use-torch-fsdp2"]),
}


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    # Each rank runs the one-process references itself (rank 0 of a world of one).
    references = {name: run_layout(BASE + flags, 1, 0, cpu, STEPS)
                  for name, flags in REFERENCES.items()}
    differences = {}
    for name, (ranks, ref, layout) in LAYOUTS.items():
        run = run_layout(BASE + REFERENCES[ref] + layout, ranks, rank, cpu, STEPS)
        differences[name] = run and first_difference(run, references[ref])
    return differences


def test_mla_with_mtp_at_every_layout_matches_one_process():
    failures = [f"rank {rank}, {name}: {difference}"
                for rank, differences in enumerate(run_distributed(4, _compare, timeout=300))
                for name, difference in differences.items() if difference is not None]
    assert not failures, "\n".join(failures)
