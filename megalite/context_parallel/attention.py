"""Causal attention over a sequence split across the context-parallel (CP) group.

Load balancing (context_split.py): CP rank i holds chunks i and 2·CP-1-i of c = s / (2·CP)
tokens, back to back: (i+1) + (2·CP-i) = 2·CP+1 causal chunk pairs of work on every rank. A
rank's rows stay in increasing global position, so a plain causal mask is right on its 2c rows.

Two ways to see the other ranks' keys and values (`--cp-comm-type`, Megatron's names):
- all_gather: K and V are all-gathered over CP (one collective; cheap with GQA, where K/V are
  smaller than Q); each local query chunk attends to its causal prefix of the gathered keys.
  Backward reduce-scatters dK, dV. The gathered K/V of the whole sequence stay alive until
  the backward. Works with every `--attention-backend`: a query chunk shorter than its key
  prefix is what core_attention's lower-right causal alignment already does.
- p2p: ring attention (ring.py): K/V blocks travel round the ring while the current block is
  computed, partial outputs merge by their log-sum-exp, backward sends dK/dV round the ring.

Communication per rank per call, B = bytes of this rank's K (or V) shard, b·(s/CP)·g·d·e
(g = key/value heads on this rank), counted as the bytes a rank receives from the others
(`cp_comm_bytes`):
- all_gather: forward 2(CP-1)B (all-gather of K and V), backward 2(CP-1)B (reduce-scatter
  of dK and dV).
- p2p: forward 2(CP-1)B (CP-1 ring steps of a K/V block), backward 2(CP-1)B (the K/V blocks
  again) + 2·CP·A (the dK/dV accumulators: CP hops, the last one home; A is B in fp32,
  the accumulators' dtype, ring.py: 2B for bf16 K/V).
"""

from typing import NamedTuple

import torch

from megalite.attention_backends import BACKENDS, checked_scale, core_attention
from megalite.context_parallel.ring import ring_attention
from megalite.context_split import load_balanced_chunks
from megalite.documents import Documents
from megalite.errors import ConfigError
from megalite.parallel_state import group_rank, group_size
from megalite.tensor_parallel.mappings import gather_from_sequence_parallel_region

COMM_TYPES = ("p2p", "all_gather")


def cp_backend_check(backend: str, comm_type: str, dropout_p: float) -> None:
    """Raise a ConfigError when `--attention-backend backend`, `--cp-comm-type comm_type` or
    attention dropout `dropout_p` is not one megalite's CP attention runs (every backend runs
    both comm types; ring.block_kernels says which kernel the ring's blocks use)."""
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {comm_type}: expected one of {', '.join(COMM_TYPES)} "
                          "(Megatron's a2a and a2a+p2p are not implemented in megalite)")
    if backend not in BACKENDS:
        raise ConfigError(f"--attention-backend {backend}: expected one of {', '.join(BACKENDS)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ConfigError(f"--attention-dropout {dropout_p}: expected 0 <= p < 1")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                               comm_type: str, backend: str, dropout_p: float = 0.0,
                               softmax_scale: float | None = None,
                               documents: Documents | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence for this CP rank's rows.

    q: [b, s_local, heads, d]; k, v: [b, s_local, kv_heads, d] (heads a multiple of kv_heads;
    v's head size may differ, multi-latent attention's), core_attention's layout. The first
    s_local/2 rows are global chunk i, the last s_local/2 chunk 2·CP-1-i (i = this CP rank,
    see load_balanced_chunks). Returns [b, s_local, heads, d_v]
    in the same local order. cp_group None or of size 1: plain core_attention. Dropout draws
    from the current default generator: the caller forks the RNG tracker so that each CP
    rank draws its own masks. `documents`: those of this rank's rows (global positions);
    attention is then block-causal (docs/design.md §28)."""
    if group_size(cp_group) == 1:
        return core_attention(q, k, v, backend=backend, dropout_p=dropout_p,
                              softmax_scale=softmax_scale, documents=documents)
    cp_backend_check(backend, comm_type, dropout_p)
    if q.shape[1] % 2 or k.shape[1] != q.shape[1]:
        raise ValueError(f"context-parallel attention needs the same even number of local "
                         f"query and key rows (two chunks), got {q.shape[1]} and {k.shape[1]}")
    scale = checked_scale(q, k, softmax_scale)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, cp_group, backend, dropout_p, scale, documents)
    return ring_attention(q, k, v, cp_group, scale, dropout_p, backend, documents)


class CommBytes(NamedTuple):
    """Bytes one CP rank receives from the others in one attention call."""
    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def cp_comm_bytes(comm_type: str, *, cp_size: int, batch: int, seq_length: int, kv_heads: int,
                  head_dim: int, element_size: int) -> CommBytes:
    """The closed form of the module docstring for one attention call (one layer, one
    micro-batch, forward + backward). seq_length is the whole sequence, kv_heads those on
    this rank (after TP), element_size the bytes per element of K and V."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type {comm_type!r} is not one of {COMM_TYPES}")
    if cp_size == 1:
        return CommBytes(0, 0)
    elements = batch * (seq_length // cp_size) * kv_heads * head_dim
    kv_ring = 2 * (cp_size - 1) * elements * element_size  # 2(CP-1)B
    if comm_type == "all_gather":
        return CommBytes(kv_ring, kv_ring)
    return CommBytes(kv_ring, kv_ring + 2 * cp_size * elements * max(element_size, 4))


# all_gather

def _global_order(gathered: torch.Tensor) -> torch.Tensor:
    """[cp, b, 2c, g, d] in rank order -> [b, 2·cp·c, g, d] in sequence order: chunk j < cp
    is rank j's first half, chunk j >= cp rank 2·cp-1-j's second half."""
    cp, b, s_local, g, d = gathered.shape
    halves = gathered.view(cp, b, 2, s_local // 2, g, d)
    chunks = torch.cat([halves[:, :, 0], halves[:, :, 1].flip(0)])  # [2cp, b, c, g, d]
    return chunks.permute(1, 0, 2, 3, 4).reshape(b, cp * s_local, g, d)


def _all_gather_attention(q, k, v, group, backend, dropout_p, scale, documents=None):
    cp, rank = group_size(group), group_rank(group)
    c = q.shape[1] // 2
    # One collective for K and V together, side by side in the last dim (their head sizes
    # differ under multi-latent attention).
    # Backward reduce-scatters dK, dV: each rank's block gets every rank's gradient for it.
    kv = torch.cat([k, v], dim=-1)
    kv_all = gather_from_sequence_parallel_region(kv, group).view(cp, *kv.shape)
    k_all, v_all = _global_order(kv_all).split([k.shape[-1], v.shape[-1]], dim=-1)
    outs = []
    for half, chunk in enumerate(load_balanced_chunks(cp, rank)):
        prefix = (chunk + 1) * c  # causal: chunk j sees chunks 0..j, its own lower-right
        rows = slice(half * c, (half + 1) * c)
        outs.append(core_attention(q[:, rows], k_all[:, :prefix], v_all[:, :prefix],
                                   backend=backend, dropout_p=dropout_p, softmax_scale=scale,
                                   documents=None if documents is None else documents.rows(rows)))
    return torch.cat(outs, dim=1)
