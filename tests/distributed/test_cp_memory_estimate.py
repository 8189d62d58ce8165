"""The memory planner's activations under context parallelism (megalite/memory_estimate/
context_parallel.py) against what autograd saves: one micro-batch through the whole model
at CP 2, the distinct storages saved for backward, on CP rank 1 (the planned rank: it holds
no chunk 0, whose mask-free causal block makes rank 0 keep a little less)."""

import pytest
import torch

import megalite.memory_estimate as me
from megalite.arguments import parse_args
from megalite.monitoring.memory import SavedActivations
from megalite.parallel_state import ParallelState
from megalite.spawn import run_distributed
from megalite.train_step import autocast
from megalite.training import build_model
from megalite.validation import validate_args

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # every test here launches processes

CP = 2
FLAGS = flags_with("--attention-dropout", "0", "--context-parallel-size", str(CP),
                   vocab_size=500, micro_batch_size=2, global_batch_size=None, train_iters=1)
ROPE_GQA_BF16 = ["--position-embedding-type", "rope", "--group-query-attention",
                 "--num-query-groups", "2", "--bf16"]
CASES = {
    "all_gather sdpa fp32": ["--cp-comm-type", "all_gather", "--attention-backend", "sdpa"],
    "all_gather sdpa rope gqa bf16": ["--cp-comm-type", "all_gather", *ROPE_GQA_BF16],
    "all_gather unfused fp32": ["--cp-comm-type", "all_gather", "--attention-backend",
                                "unfused"],
    "p2p fp32": ["--attention-backend", "unfused"],
    "p2p rope gqa bf16": ["--attention-backend", "unfused", *ROPE_GQA_BF16],
    # The default backend: the ring's blocks on torch's fused kernels, which save nothing
    # the ring does not (it keeps q, k, v, out, lse whatever the block kernel).
    "p2p auto rope gqa bf16": ROPE_GQA_BF16,
    "p2p selective": ["--attention-backend", "unfused", "--recompute-granularity",
                      "selective"],
}


def saved_bytes(config, chunk) -> int:
    """What autograd saves in one forward of this CP rank's chunk of a micro-batch."""
    m = config.model
    tokens = torch.randint(0, m.vocab_size, (config.training.micro_batch_size,
                                             m.seq_length // CP))

    with SavedActivations(chunk) as saved, autocast(config.precision, torch.device("cpu")):
        chunk(tokens, tokens)
    return saved.nbytes


def measure(rank, world_size):
    results = {}
    for name, flags in CASES.items():
        config = validate_args(parse_args(FLAGS + flags), world_size)
        state = ParallelState(config.parallel.grid, rank)
        chunk = build_model(config, state, torch.device("cpu"), None)[0]
        planned = me.rank_chunks(config, 0, me.DEVICES["cpu"])[0].saved
        results[name] = (saved_bytes(config, chunk), planned)
    return results


def test_planned_activations_match_saved_tensors_at_cp2():
    measured = run_distributed(CP, measure)[1]
    mismatches = {name: (got, want) for name, (got, want) in measured.items() if got != want}
    assert not mismatches, mismatches
