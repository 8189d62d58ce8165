"""Ring-attention blocks on torch's fused flash-attention kernels: blocks.py's interface and
results, without its [b, heads, s_q, s_k] fp32 scores (c = 8k rows, 32 heads: 16 GiB a block).

Each block runs FlashAttention's tiled forward, which returns the block's log-sum-exp, and
its backward given the MERGED out and lse of the whole row, as blocks.block_backward (whose
docstring shows why each block's dQ, dK, dV are then its exact share). TransformerEngine's
ring and torch's own context parallel (torch/distributed/tensor/experimental/
_context_parallel/_attention.py) do the same.

Kernels (torch.ops.aten, layout [b, heads, s, d]; megalite's [b, s, heads, d] is a view):
- CPU: _scaled_dot_product_flash_attention_for_cpu and its _backward (any float dtype).
- CUDA: _scaled_dot_product_flash_attention and its _backward (`cuda_unavailable_reason`),
  written against torch 2.13's schemas and NOT run on a GPU.

Differences from the kernels' own conventions, handled here:
- Causal masks: the ring's are aligned to the lower right, is_causal to the upper left. A
  causal block with more keys than rows (the c x 2c diagonal block) runs as an unmasked
  block of the first s_k - s_q keys plus a causal square of the last s_q, merged.
- GQA: none to handle. Both kernels take fewer K/V heads than query heads (query head i
  reads K/V head i // (heads / kv_heads), as SDPA's enable_gqa, which calls them so) and
  return dK, dV per K/V head, summed over the group inside the op.
- Dtypes: q, k, v in their own dtype, the log-sum-exp in fp32 (fp64 for fp64 inputs);
  out, lse, dq, dk, dv are returned in (at least) fp32, as blocks.py's, so the merge and
  the ring's accumulators stay in fp32. Each block's output is rounded to the input dtype
  by the kernel before the merge (as in TransformerEngine).
- No dropout (ring.py runs blocks.py then): the CPU kernel has none, and a CUDA block's
  philox mask is not redrawn here.
- A V head size below Q/K's (multi-latent attention): both kernels take one head size, so
  each block zero-pads V to it and drops the padding columns of out and dV (they are zero in
  out; dout's are zero too). The ring itself carries V unpadded.
"""

import torch
import torch.nn.functional as F

from megalite.context_parallel.blocks import merge

aten = torch.ops.aten


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the fused kernels cannot run a block of this device, dtype and head size (None
    when they can)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":  # gpu_check: ring_attention
        return f"torch has no fused flash kernel with a log-sum-exp on {device.type}"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no CUDA flash kernel"
    # gpu_check: ring_attention
    return cuda_unavailable_reason(torch.cuda.get_device_capability(device), dtype, head_dim)


def cuda_unavailable_reason(capability: tuple[int, int], dtype: torch.dtype,
                            head_dim: int) -> str | None:
    """Why torch's CUDA flash kernel cannot run the ring's blocks, forward and backward
    without dropout, on a GPU of this compute capability (None when it can)."""
    if capability < (8, 0):
        return "torch's CUDA flash kernel needs an sm80 or newer GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"torch's CUDA flash kernel needs fp16 or bf16 (--fp16/--bf16), not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"torch's CUDA flash kernel needs a head size <= 256 in steps of 8, not {head_dim}"
    # The backward's kernel for head sizes 200-224 needs more shared memory than these
    # GPUs have (A10, L4, L40S, RTX 30/40/50); torch's SDPA gate refuses them the same way
    # (sdp_utils.cpp, check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120).
    # 232-256 runs there without dropout, which these blocks never have.
    if ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)) and \
            192 < head_dim <= 224:
        return (f"torch's CUDA flash backward on sm{capability[0]}{capability[1]} cannot run "
                f"head size {head_dim} (head sizes 200-224 need an sm80 or sm90 GPU)")
    return None


def _parts(s_q: int, s_k: int, causal: bool) -> list[tuple[slice, bool]]:
    """(keys, is_causal) squares-or-unmasked parts of a block whose causal mask is aligned to
    the lower right, each right for the kernels' upper-left is_causal."""
    if not causal:
        return [(slice(0, s_k), False)]
    if s_k < s_q:
        raise ValueError(f"a causal block of {s_q} query rows and {s_k} keys leaves rows "
                         f"with no key; the ring never computes one")
    early = [(slice(0, s_k - s_q), False)] if s_k > s_q else []
    return early + [(slice(s_k - s_q, s_k), True)]


def _kernel_forward(q, k, v, causal: bool, scale: float):
    """One kernel call on [b, s, heads, d] views: (out [b, s_q, heads, d], lse, the state
    the CUDA backward needs)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal,
                                                                    scale=scale)
        return out.transpose(1, 2), lse, None
    out, lse, cum_q, cum_k, max_q, max_k, philox_seed, philox_offset, _ = (
        aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale))
    return out.transpose(1, 2), lse, (cum_q, cum_k, max_q, max_k, philox_seed, philox_offset)


def _kernel_backward(dout, q, k, v, out, lse, causal: bool, scale: float, state):
    dot, qt, kt, vt, ot = (t.transpose(1, 2) for t in (dout, q, k, v, out))
    if q.device.type == "cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dot, qt, kt, vt, ot, lse, 0.0, causal, scale=scale)
    else:
        cum_q, cum_k, max_q, max_k, philox_seed, philox_offset = state
        grads = aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, philox_seed,
            philox_offset, scale=scale)
    return (g.transpose(1, 2) for g in grads)


def block_forward(q, k, v, *, causal: bool, scale: float, dropout_p: float = 0.0):
    """As blocks.block_forward: (out [b, s_q, heads, d], lse [b, heads, s_q], both fp32, and
    the kernels' state for block_backward, passed as its rng_state)."""
    if dropout_p > 0:
        raise ValueError("the fused ring blocks have no dropout; ring.py runs blocks.py")
    acc = torch.promote_types(q.dtype, torch.float32)
    d_v, v = v.shape[-1], _padded(v, q.shape[-1])
    out, lse, states = None, None, []
    for keys, part_causal in _parts(q.shape[1], k.shape[1], causal):
        part_out, part_lse, state = _kernel_forward(q, k[:, keys], v[:, keys], part_causal, scale)
        part_out, part_lse = part_out.to(acc), part_lse.to(acc)
        states.append(state)
        out, lse = (part_out, part_lse) if out is None else merge(out, lse, part_out, part_lse)
    return out[..., :d_v], lse, states


def _padded(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x with its last dim zero-padded to head_dim (module docstring: V under MLA)."""
    return x if x.shape[-1] == head_dim else F.pad(x, (0, head_dim - x.shape[-1]))


def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float,
                   dropout_p: float = 0.0, rng_state=None):
    """As blocks.block_backward: (dq, dk, dv) in fp32, this block's share, given the MERGED
    out and lse of q's rows over every block; rng_state is what block_forward returned."""
    if dropout_p > 0:
        raise ValueError("the fused ring blocks have no dropout; ring.py runs blocks.py")
    parts = _parts(q.shape[1], k.shape[1], causal)
    states = rng_state if rng_state is not None else [None] * len(parts)
    d_v = v.shape[-1]
    dout, out, v = (_padded(t, q.shape[-1]) for t in (dout.to(q.dtype), out.to(q.dtype), v))
    # The kernels read the log-sum-exp as a contiguous [b, heads, s_q] (torch's ring does
    # the same for its slices); the kernel's own dtype is fp32 (fp64 for fp64 inputs).
    lse = lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous()
    dq, dks, dvs = 0, [], []
    for (keys, part_causal), state in zip(parts, states):
        dq_p, dk_p, dv_p = _kernel_backward(dout, q, k[:, keys], v[:, keys], out, lse,
                                            part_causal, scale, state)
        dq = dq + dq_p.to(lse.dtype)
        dks.append(dk_p.to(lse.dtype))
        dvs.append(dv_p[..., :d_v].to(lse.dtype))
    return dq, torch.cat(dks, dim=1), torch.cat(dvs, dim=1)
