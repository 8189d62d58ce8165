"""Documents kept apart (--reset-position-ids, --reset-attention-mask,
--dataloader-inter-document-masking; docs/design.md §28) at every kind of layout against one
process with the same flags: TP 2 + SP, PP 2 interleaved, ZB-H1, DP 2 ZeRO-1, FSDP2, CP 2 on
the ring and on all_gather, CP 2 x TP 2, EP 2 (MoE). The mock corpus's documents (1 to 10
tokens and their EOD) are far shorter than the 16-token samples, so every sample holds
several and the CP chunks cut through them. fp32, dropout 0: the same initial values,
per-step losses and grad norms, and values after each update. One launch of 4 ranks."""

import pytest
import torch

from megalite.layout_check import first_difference, run_layout
from megalite.spawn import run_distributed

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

STEPS = 2
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask"]
BASE = flags_with("--group-query-attention", "--num-query-groups", "2", "--swiglu",
                  "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                  "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
                  "--num-workers", "0", *DOCUMENTS, vocab_size=12, hidden_size=32,
                  ffn_hidden_size=64, num_layers=4, seq_length=16, micro_batch_size=1,
                  global_batch_size=4, lr="3e-3")
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.1",
       "--moe-token-dispatcher-type", "alltoall"]
LEARNED = ["--position-embedding-type", "learned_absolute", "--attention-backend", "unfused",
           "--dataloader-inter-document-masking"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
# name: (ranks, the reference's flags beyond BASE, the layout's flags beyond those)
LAYOUTS = {
    "TP 2 + SP": (2, [], TP2),
    "PP 2 interleaved": (2, [], ["--pipeline-model-parallel-size", "2",
                                 "--num-layers-per-virtual-pipeline-stage", "1"]),
    "PP 2 zb-h1": (2, [], ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                           "zb-h1"]),
    "DP 2 ZeRO-1": (2, [], ["--use-distributed-optimizer", "--overlap-grad-reduce",
                            "--overlap-param-gather"]),
    "DP 2 FSDP2": (2, [], ["--use-torch-fsdp2"]),
    "CP 2 p2p": (2, [], CP2 + ["--cp-comm-type", "p2p"]),
    "CP 2 all_gather": (2, [], CP2 + ["--cp-comm-type", "all_gather"]),
    "CP 2 x TP 2 p2p": (4, [], CP2 + TP2),
    "EP 2": (2, MOE, ["--expert-model-parallel-size", "2"]),
    # GPT-2's learned positions, the dataset's own boundaries, the unfused mask.
    "CP 2 all_gather, learned positions": (2, LEARNED, CP2 + ["--cp-comm-type",
                                                              "all_gather"]),
}


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    # Each rank runs the one-process references itself (rank 0 of a world of one).
    references = {tuple(ref): run_layout(BASE + ref, 1, 0, cpu, STEPS)
                  for ref in ([], MOE, LEARNED)}
    plain = run_layout([f for f in BASE if f not in DOCUMENTS], 1, 0, cpu, STEPS)
    differences = {"the flags change the run": None if plain.steps != references[()].steps
                   else "no: same steps"}
    for name, (ranks, ref, layout) in LAYOUTS.items():
        run = run_layout(BASE + ref + layout, ranks, rank, cpu, STEPS)
        differences[name] = run and first_difference(run, references[tuple(ref)])
    return differences


def test_document_masks_at_every_layout_match_one_process():
    failures = [f"rank {rank}, {name}: {difference}"
                for rank, differences in enumerate(run_distributed(4, _compare, timeout=300))
                for name, difference in differences.items() if difference is not None]
    assert not failures, "\n".join(failures)
