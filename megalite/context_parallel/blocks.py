"""Attention of a block of query rows against a block of keys, with its log-sum-exp, the
exact merge of such partial results, and the block's backward from the merged result.

Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, §3.1): a block
of keys gives out_b = softmax(S_b) V_b and lse_b = log Σ_j exp(S_bj) per query row. Two
blocks of the same rows merge exactly into lse = log(e^lse_1 + e^lse_2) and
out = e^(lse_1 - lse) out_1 + e^(lse_2 - lse) out_2. Dropout keeps this exact: it scales
each probability by its own mask, which is linear in every block.

Backward (FlashAttention's): with the merged out and lse of the whole row, a block's
probabilities are P_b = exp(S_b - lse), so each block's gradients follow from the saved
q, k, v, out, lse alone, block by block:
  dV_b = (P_b∘Z)ᵀ dO,  dP_b = (dO V_bᵀ)∘Z,  dS_b = P_b∘(dP_b - D),  D = rowsum(dO∘O),
  dQ += dS_b K_b · scale,  dK_b = dS_bᵀ Q · scale,
Z being the block's dropout mask over (1-p), redrawn from the generator state saved when
the forward drew it.

Layout as core_attention: q [b, s_q, heads, d], k and v [b, s_k, kv_heads, d]; lse
[b, heads, s_q]. Query head i reads key/value head i // (heads / kv_heads); K and V are
never repeated (the group is a broadcast dim). Scores, probabilities and accumulators are
in (at least) fp32, as the unfused backend's.
"""

import torch

from megalite.attention_backends import future_keys
from megalite.tensor_parallel.random import get_device_rng_state


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """[b, s, heads, d] -> [b, g, heads/g, s, d] in (at least) fp32, g = kv_heads: q, its
    output and gradient [b, g, heads/g, s_q, d], k and v [b, g, 1, s_k, d]."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).transpose(1, 2).unflatten(1, (g, -1))


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """[b, g, heads/g, s, d] -> [b, s, heads, d]."""
    return x.flatten(1, 2).transpose(1, 2)


def _scores(qg, kg, causal: bool, scale: float, visible=None) -> torch.Tensor:
    scores = qg @ kg.transpose(-2, -1) * scale            # [b, g, h/g, s_q, s_k]
    if visible is not None:  # [b, s_q, s_k]: documents (block-causal)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if causal:  # aligned to the lower right, as core_attention's
        scores = scores.masked_fill(future_keys(*scores.shape[-2:], scores.device), float("-inf"))
    return scores


def _dropout_mask(shape, p: float, device, generator=None) -> torch.Tensor:
    """Keep-mask over (1-p), drawn from `generator` (default: the device's default one)."""
    keep = torch.empty(shape, device=device).bernoulli_(1.0 - p, generator=generator)
    return keep / (1.0 - p)


def block_forward(q, k, v, *, causal: bool, scale: float, dropout_p: float = 0.0,
                  visible=None):
    """(out [b, s_q, heads, d] in fp32, lse [b, heads, s_q] in fp32, rng_state): attention
    of q's rows against this block of keys only. rng_state is the default generator's state
    before the dropout draw (None without dropout), for block_backward. `visible`
    [b, s_q, s_k] bool: the keys each row sees (documents); a row that sees none gets out 0
    and lse -inf, which merges as nothing. Differentiable, so a test can take its gradients
    with autograd."""
    qg, kg, vg = (_grouped(t, k.shape[2]) for t in (q, k, v))
    scores = _scores(qg, kg, causal, scale, visible)
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    rng_state = None
    if dropout_p > 0:
        rng_state = get_device_rng_state(q.device)
        probs = probs * _dropout_mask(probs.shape, dropout_p, q.device)
    out = _ungroup(probs @ vg)
    return out, lse.flatten(1, 2), rng_state


def merge(out, lse, block_out, block_lse):
    """Merge two partial results of the same query rows (module docstring); out
    [b, s, heads, d], lse [b, heads, s], all fp32. Returns the merged (out, lse)."""
    new_lse = torch.logaddexp(lse, block_lse)
    weight = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)              # [b, s, h, 1]
    block_weight = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * weight + block_out * block_weight, new_lse


def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float,
                   dropout_p: float = 0.0, rng_state=None, visible=None):
    """(dq, dk, dv) in fp32, this block's part of the gradients, given the MERGED out and lse
    of q's rows over every block (module docstring) and the gradient dout of out."""
    g = k.shape[2]
    qg, kg, vg, dog, og = (_grouped(t, g) for t in (q, k, v, dout, out))
    lse_g = lse.to(qg.dtype).unflatten(1, (g, -1)).unsqueeze(-1)
    probs = torch.exp(_scores(qg, kg, causal, scale, visible) - lse_g)  # P_b, masked: 0
    dprobs = dog @ vg.transpose(-2, -1)                            # dO V_bᵀ
    kept = probs
    if dropout_p > 0:
        generator = torch.Generator(device=q.device).set_state(rng_state)
        mask = _dropout_mask(probs.shape, dropout_p, q.device, generator)
        kept, dprobs = probs * mask, dprobs * mask
    delta = (dog * og).sum(dim=-1, keepdim=True)                   # D
    dscores = probs * (dprobs - delta)
    dq = _ungroup(dscores @ kg) * scale
    dk = (dscores.transpose(-2, -1) @ qg).sum(dim=2).permute(0, 2, 1, 3) * scale
    dv = (kept.transpose(-2, -1) @ dog).sum(dim=2).permute(0, 2, 1, 3)
    return dq, dk, dv
