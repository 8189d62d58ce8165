"""Ring attention over the CP group (Liu et al. 2023; Megatron's `--cp-comm-type p2p`).

CP rank r holds query/key rows of chunks r and 2·CP-1-r (c rows each, attention.py). At ring
step t it holds the K/V block of CP rank src = (r - t) mod CP, sent on from its previous
neighbour, and computes its blocks (`ring_blocks`), skipping every fully masked pair of
chunks; that leaves 2·CP+1 pairs of c x c scores on every rank, in three cases:
- src == r (t = 0): its own keys, in two causal blocks: chunk r against itself (c x c) and
  chunk 2·CP-1-r against both (c x 2c: the lower-right causal mask leaves chunk r unmasked
  and is causal within the diagonal pair); chunk r against 2·CP-1-r, fully masked, is skipped;
- src < r: both query chunks against chunk src, unmasked; chunk 2·CP-1-src comes after both
  query chunks, a fully masked pair, skipped;
- src > r: only chunk 2·CP-1-r's queries, against both of src's chunks, unmasked; query chunk
  r comes before both, fully masked, skipped.
While a block is computed the next K/V block is already on its way (one batch_isend_irecv:
send to the next rank, receive from the previous, the order every rank agrees on, as NCCL
needs; docs/design.md §11). Partial outputs merge by their log-sum-exp (blocks.py).

Each block runs on one of two kernels with the same interface (`block_kernels`, following
--attention-backend): unfused, blocks.py, the explicit fp32 reference that materialises the
block's scores; sdpa and flash, fused_blocks.py, torch's flash kernels (CPU and CUDA), whose
memory is linear in the block's rows. Attention dropout, and a device or dtype the fused
kernels lack under sdpa, run blocks.py (exact either way).

Backward walks the same ring: each rank recomputes its blocks from the saved q, k, v, out,
lse (block_backward), adds the block's dK/dV to the accumulator that arrived with it
and sends that on; after CP hops every accumulator is back home holding the sum over ranks.
The accumulators are fp32 (as torch's context parallel's), rounded to the K/V dtype once
at home: in bf16 each hop would round the partial sum again.
"""

import torch
import torch.distributed as dist

from megalite.context_parallel import blocks, fused_blocks
from megalite.context_parallel.blocks import merge
from megalite.context_split import local_positions
from megalite.documents import Documents
from megalite.errors import ConfigError
from megalite.parallel_state import group_rank, group_size


def block_kernels(backend: str, q: torch.Tensor, dropout_p: float, documents=None):
    """The module (blocks or fused_blocks) whose block_forward / block_backward run the ring's
    blocks for resolved `backend` (module docstring). flash asks for a fused kernel: where
    torch's cannot run, a ConfigError says why rather than a silent O(c^2)-memory kernel.
    Document masks run blocks.py, the one block kernel that takes a mask (validation refuses
    them with flash)."""
    if documents is not None and backend == "flash":
        raise ConfigError("--reset-attention-mask with --cp-comm-type p2p runs the ring's blocks "
                          "on megalite's masked block kernel, not flash-attn: use "
                          "--attention-backend sdpa or --cp-comm-type all_gather")
    if backend == "unfused" or dropout_p > 0 or documents is not None:
        return blocks
    reason = fused_blocks.unavailable_reason(q.device, q.dtype, q.shape[-1])
    if reason is None:
        return fused_blocks
    if backend == "flash":
        raise ConfigError(f"--attention-backend flash with --cp-comm-type p2p runs each ring "
                          f"block on torch's flash kernel, which cannot run here: {reason}; "
                          f"use --attention-backend sdpa or unfused (megalite's fp32 block "
                          f"kernel), or --cp-comm-type all_gather")
    return blocks


def ring_blocks(cp_size: int, cp_rank: int, src: int, c: int) -> list[tuple[slice, slice, bool]]:
    """The (query rows, key rows of src's block, causal) that rank `cp_rank` computes against
    rank `src`'s K/V block (module docstring); rows are local, c per chunk. Causal masks are
    aligned to the lower right (a query block shorter than its keys ends with them)."""
    if src == cp_rank:  # chunk r against itself; chunk 2·CP-1-r against r, then itself
        return [(slice(0, c), slice(0, c), True), (slice(c, 2 * c), slice(0, 2 * c), True)]
    if src < cp_rank:
        return [(slice(0, 2 * c), slice(0, c), False)]
    return [(slice(c, 2 * c), slice(0, 2 * c), False)]


def _blocks(cp, rank, src, c, documents: Documents | None):
    """(rows, keys, causal, visible) of the blocks to compute against src's K/V block:
    ring_blocks, or under a document mask the blocks in which some row sees some key, with
    `visible` [b, rows, keys]; a block whose keys all lie before every document of its rows
    is skipped (docs/design.md §28)."""
    if documents is None:
        return [(rows, keys, causal, None) for rows, keys, causal in ring_blocks(cp, rank, src, c)]
    key_positions = local_positions(2 * cp * c, cp, src)  # on the host
    out = []
    for rows, keys, _ in ring_blocks(cp, rank, src, c):
        positions = key_positions[keys]
        if src != rank and documents.first_visible_key(rows) > positions.max().item():
            continue
        out.append((rows, keys, False, documents.rows(rows).visible(positions)))
    return out


def _ring_start(tensor: torch.Tensor, group):
    """Send `tensor` to the next CP rank while receiving one from the previous."""
    cp, rank = group_size(group), group_rank(group)
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group)])
    return works, tensor, received  # the sent tensor is held until the works are done


def _ring_wait(pending) -> torch.Tensor:
    works, _, received = pending
    for work in works:  # each once: a gloo work waited twice blocks forever
        work.wait()
    return received


def _ring_steps(k, v, group, documents: Documents | None):
    """For each ring step t: (t, the K/V block held then, the blocks to compute against it),
    the next K/V block on its way while the caller computes (and sends its own messages)."""
    cp, rank = group_size(group), group_rank(group)
    # One message per step for K and V, side by side in the last dim (their head sizes
    # differ under multi-latent attention).
    kv = torch.cat([k, v], dim=-1)
    for t in range(cp):
        pending = _ring_start(kv, group) if t < cp - 1 else None
        yield t, kv, _blocks(cp, rank, (rank - t) % cp, k.shape[1] // 2, documents)
        if pending is not None:
            kv = _ring_wait(pending)


class _RingAttention(torch.autograd.Function):
    """Autocast is switched off inside: the blocks' scores (blocks.py), log-sum-exps and
    accumulators are fp32 by design (bf16 scores would lose the log-sum-exp's precision),
    and the fused kernels take q, k, v in their own dtype."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, dropout_p, kernels, documents):
        with torch.autocast(q.device.type, enabled=False):
            d_k = k.shape[-1]
            # No keys yet: a zero output of weight exp(-inf); step 0 then covers every row.
            out = q.new_zeros((*q.shape[:-1], v.shape[-1]),
                              dtype=torch.promote_types(q.dtype, torch.float32))
            lse = out.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"))
            rng_states = []  # one per block, in the order computed
            for _, kv, kv_blocks in _ring_steps(k, v, group, documents):
                for rows, keys, causal, visible in kv_blocks:
                    block_out, block_lse, rng_state = kernels.block_forward(
                        q[:, rows], kv[:, keys, ..., :d_k], kv[:, keys, ..., d_k:],
                        causal=causal, scale=scale, dropout_p=dropout_p, **_mask(visible))
                    rng_states.append(rng_state)
                    out[:, rows], lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows],
                                                          block_out, block_lse)
            out = out.to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.group, ctx.scale, ctx.dropout_p = group, scale, dropout_p
            ctx.rng_states, ctx.kernels, ctx.documents = rng_states, kernels, documents
            return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            q, k, v, out, lse = ctx.saved_tensors
            group, d_k = ctx.group, k.shape[-1]
            dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
            dkv_pending, rng_states = None, iter(ctx.rng_states)
            for t, kv, kv_blocks in _ring_steps(k, v, group, ctx.documents):
                grads = []
                for rows, keys, causal, visible in kv_blocks:
                    dq_b, dk_b, dv_b = ctx.kernels.block_backward(
                        dout[:, rows], q[:, rows], kv[:, keys, ..., :d_k], kv[:, keys, ..., d_k:],
                        out[:, rows], lse[:, :, rows], causal=causal, scale=ctx.scale,
                        dropout_p=ctx.dropout_p, rng_state=next(rng_states), **_mask(visible))
                    dq[:, rows] += dq_b
                    grads.append((keys, dk_b, dv_b))
                # The block's accumulator: what earlier ranks added (none at t = 0, the block
                # starts here) plus this rank's part; then it moves on with the block.
                dkv = torch.zeros_like(kv, dtype=dq.dtype) if t == 0 else _ring_wait(dkv_pending)
                for keys, dk_b, dv_b in grads:
                    dkv[:, keys, ..., :d_k] += dk_b
                    dkv[:, keys, ..., d_k:] += dv_b
                dkv_pending = _ring_start(dkv, group)
            # This rank's own block, home after CP hops.
            dk, dv = _ring_wait(dkv_pending).to(k.dtype).split([d_k, v.shape[-1]], dim=-1)
            return dq.to(q.dtype), dk, dv, None, None, None, None, None


def _mask(visible) -> dict:
    """The block kernel's mask argument: only blocks.py takes one (block_kernels)."""
    return {} if visible is None else {"visible": visible}


def ring_attention(q, k, v, group, scale: float, dropout_p: float, backend: str,
                   documents: Documents | None = None) -> torch.Tensor:
    """Causal attention over the CP group's whole sequence for this rank's rows (attention.py
    gives the layout); checked inputs, CP > 1, `backend` resolved (block_kernels).
    `documents`: those of this rank's rows; attention is then block-causal."""
    return _RingAttention.apply(q, k, v, group, scale, dropout_p,
                                block_kernels(backend, q, dropout_p, documents), documents)
