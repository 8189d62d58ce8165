"""Ring attention's blocks on this device, every CP rank's in one process: what
ring_attention.py and mla_paths.py compare against whole-sequence attention. The fused
kernels (fused_blocks.py: torch's CUDA flash kernel in bf16 on a GPU, its CPU kernel in fp32
under SMOKE) run each rank's ring blocks (ring.ring_blocks), merged by their log-sum-exp
(blocks.merge) in fp32, the output rounded to the input dtype as ring.py rounds it; the
backward of each block from the merged out and lse, dK/dV summed over the ranks in fp32."""

import torch

from benchmarks.gpu.runs import GPU
from megalite.context_parallel import fused_blocks
from megalite.context_parallel.blocks import merge
from megalite.context_parallel.ring import ring_blocks
from megalite.context_split import load_balanced_chunks

DEVICE = torch.device("cuda", 0) if GPU else torch.device("cpu")


def emulated_ring(cp, q, k, v, dout):
    """(out, dq, dk, dv) in sequence order from every CP rank's fused ring blocks (V's head
    size may differ from Q/K's, as multi-latent attention's: mla_paths.py)."""
    b, s, h, d = q.shape
    c, scale, d_v = s // (2 * cp), d ** -0.5, v.shape[-1]
    rows_of = [torch.cat([torch.arange(j * c, (j + 1) * c) for j in load_balanced_chunks(cp, r)])
               .to(DEVICE) for r in range(cp)]
    out_all, dq_all = torch.zeros(b, s, h, d_v, device=DEVICE), torch.zeros(q.shape, device=DEVICE)
    dk, dv = torch.zeros(k.shape, device=DEVICE), torch.zeros(v.shape, device=DEVICE)
    for rank, idx in enumerate(rows_of):
        out = torch.zeros(b, 2 * c, h, d_v, device=DEVICE)
        lse = torch.full((b, h, 2 * c), float("-inf"), device=DEVICE)
        plan = []
        for src in range(cp):
            kidx = rows_of[src]
            for rows, keys, causal in ring_blocks(cp, rank, src, c):
                o, l_, state = fused_blocks.block_forward(
                    q[:, idx[rows]], k[:, kidx[keys]], v[:, kidx[keys]], causal=causal,
                    scale=scale)
                out[:, rows], lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows], o, l_)
                plan.append((rows, kidx[keys], causal, state))
        out = out.to(q.dtype)  # as ring.py returns and saves it
        out_all[:, idx] = out.float()
        for rows, keys, causal, state in plan:
            dq_b, dk_b, dv_b = fused_blocks.block_backward(
                dout[:, idx[rows]], q[:, idx[rows]], k[:, keys], v[:, keys], out[:, rows],
                lse[:, :, rows], causal=causal, scale=scale, rng_state=state)
            dq_all[:, idx[rows]] += dq_b
            dk[:, keys] += dk_b
            dv[:, keys] += dv_b
    return [out_all, dq_all, dk, dv]
