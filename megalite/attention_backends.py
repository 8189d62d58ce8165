"""Core causal attention, softmax(Q K^T * scale) V, behind `--attention-backend`.

- flash: the flash-attn package's kernels (FlashAttention, Dao et al. 2022): tiled, the
  s x s score matrix is never stored, CUDA with fp16/bf16 only.
- sdpa: torch's scaled_dot_product_attention, which dispatches to fused flash-style
  kernels on CUDA and on the CPU.
- unfused: the explicit reference; materialises the [b, h, s, s] scores and probabilities.
- auto: the fastest of these that can run here.

Grouped-query attention (GQA, Ainslie et al. 2023): query head i reads K/V head
i // (num_heads / num_kv_heads). flash and sdpa take the grouped K/V as they are; only
the reference repeats them.

All tensors are [batch, seq, heads, head_dim], the layout flash-attn takes. A query may
be shorter than the keys (generation with a KV cache): its s_q positions are then the last
of the s_k, so query i sees keys 0..i + s_k - s_q (causal, aligned to the lower right).
"""

import functools
import math

import torch
import torch.nn.functional as F

from megalite.errors import ConfigError

BACKENDS = ("auto", "flash", "sdpa", "unfused")


@functools.cache
def flash_attn_available() -> bool:
    # Imported lazily: flash-attn is an optional CUDA-only package no CPU path may import.
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if not flash_attn_available():
        return "the flash-attn package is not installed (pip install flash-attn)"
    # Only reached once flash-attn imported, i.e. on a machine with a GPU build.
    if device.type != "cuda":  # gpu_check: gpu_tests
        return f"it needs a CUDA device, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it needs --bf16 or --fp16, not {dtype}"
    return None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend for `--attention-backend name` on this device and dtype."""
    if name not in BACKENDS:
        raise ConfigError(f"--attention-backend {name}: expected one of {', '.join(BACKENDS)}")
    reason = _flash_unavailable_reason(device, dtype)
    if name == "auto":
        return "sdpa" if reason else "flash"
    if name == "flash" and reason:
        raise ConfigError(f"--attention-backend flash (or --use-flash-attn) cannot run: "
                          f"{reason}; use --attention-backend auto or sdpa instead")
    return name


def _flash(q, k, v, dropout_p, scale):
    from flash_attn import flash_attn_func

    # flash-attn >= 2.1 aligns its causal mask to the lower right, as a shorter query needs.
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=True)


def _sdpa(q, k, v, dropout_p, scale):
    # SDPA wants [b, h, s, d]; transposes are views, and enable_gqa shares each K/V head
    # across its group inside the kernel instead of materialising repeated K/V.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    # is_causal aligns to the upper left, right only for s_q == s_k. One new token sees
    # every key; a longer query shorter than the keys needs its lower-right band.
    sq, sk = q.shape[2], k.shape[2]
    mask = None if sq in (1, sk) else _future(sq, sk, q.device).logical_not()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         is_causal=sq == sk, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _unfused(q, k, v, dropout_p, scale):
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    # Scores and softmax in (at least) fp32, as Megatron's attention_softmax_in_fp32:
    # exp() of fp16/bf16 scores loses the small probabilities.
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(acc) @ k.to(acc).transpose(-2, -1) * scale
    future = _future(q.shape[2], k.shape[2], q.device)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return (probs.to(v.dtype) @ v).transpose(1, 2)


def _future(sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk], True where query i may not see key j: the keys after position i + sk - sq."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1 + sk - sq)


_KERNELS = {"flash": _flash, "sdpa": _sdpa, "unfused": _unfused}


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str,
                   dropout_p: float = 0.0, softmax_scale: float | None = None) -> torch.Tensor:
    """Causal attention. q: [b, s_q, heads, d]; k, v: [b, s_k, kv_heads, d] with heads a
    multiple of kv_heads and s_q <= s_k; returns [b, s_q, heads, d]. `backend` is a
    resolved one (see resolve_backend); softmax_scale defaults to 1/sqrt(d)."""
    if backend not in _KERNELS:
        raise ValueError(f"backend {backend!r} is not one of {tuple(_KERNELS)}; "
                         "pass the result of resolve_backend()")
    return _KERNELS[backend](q, k, v, dropout_p, checked_scale(q, k, softmax_scale))


def checked_scale(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None) -> float:
    """softmax_scale, default 1/sqrt(d), once q's heads are checked to be a multiple of k's."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads is not a multiple of "
                         f"{k.shape[2]} key/value heads")
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
