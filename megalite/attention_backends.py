"""Core causal attention, softmax(Q K^T * scale) V, behind `--attention-backend`.

- flash: the flash-attn package's kernels (FlashAttention, Dao et al. 2022): tiled, the
  s x s score matrix is never stored, CUDA with fp16/bf16 only.
- sdpa: torch's scaled_dot_product_attention, which dispatches to fused flash-style
  kernels on CUDA and on the CPU.
- unfused: the explicit reference; materialises the [b, h, s, s] scores and probabilities.
- flex: torch's FlexAttention (compiled), CUDA only: its backward does not run on CPUs
  in torch 2.13. It takes a document mask as a block mask; plain causal attention runs
  SDPA, whose flash kernel is as fast.
- auto: the fastest of these that can run here (flash where installed, else sdpa).

Documents (megalite/documents.py, --reset-attention-mask): attention is block-causal, and no
[s, s] mask is built where the kernel takes boundaries: flash runs flash_attn_varlen_func on
the documents' cu_seqlens, sdpa causal calls on the documents as padded batches, one per
length bucket (so its cost is that of the documents, about L/S of causal attention for
documents of mean length L in a sequence of S), flex a block mask; only unfused builds the
[b, s, s] mask.

Grouped-query attention (GQA, Ainslie et al. 2023): query head i reads K/V head
i // (num_heads / num_kv_heads). flash and sdpa take the grouped K/V as they are; only
the reference repeats them.

All tensors are [batch, seq, heads, head_dim], the layout flash-attn takes. A query may
be shorter than the keys (generation with a KV cache): its s_q positions are then the last
of the s_k, so query i sees keys 0..i + s_k - s_q (causal, aligned to the lower right).
"""

import functools
import itertools
import math

import torch
import torch.nn.functional as F

from megalite.documents import Documents, gather_rows
from megalite.errors import ConfigError

BACKENDS = ("auto", "flash", "flex", "sdpa", "unfused")


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
    if name == "flex" and device.type != "cuda":  # gpu_check: document_attention
        raise ConfigError(f"--attention-backend flex (FlexAttention) cannot train on "
                          f"{device.type}: its backward runs on CUDA only (torch 2.13); use "
                          "--attention-backend sdpa")
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
    mask = None if sq in (1, sk) else future_keys(sq, sk, q.device).logical_not()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         is_causal=sq == sk, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _unfused(q, k, v, dropout_p, scale, hidden: torch.Tensor | None = None):
    """`hidden`: [b, 1, s_q, s_k] True where a query may not see a key (default: causal)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    # Scores and softmax in (at least) fp32, as Megatron's attention_softmax_in_fp32:
    # exp() of fp16/bf16 scores loses the small probabilities.
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(acc) @ k.to(acc).transpose(-2, -1) * scale
    if hidden is None:
        hidden = future_keys(q.shape[2], k.shape[2], q.device)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return (probs.to(v.dtype) @ v).transpose(1, 2)


def future_keys(sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk], True where query i may not see key j: the keys after position i + sk - sq."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1 + sk - sq)


def _padded_value(kernel):
    """`kernel` for a V head size below Q/K's (multi-latent attention): flash-attn's kernels
    take one head size for Q, K and V, so V is zero-padded to it and the output's padding
    columns (zero) dropped; the padding costs (d_qk - d_v) / d_v more of the P V product."""
    def run(q, k, v, *args):
        pad = q.shape[-1] - v.shape[-1]
        if pad == 0:
            return kernel(q, k, v, *args)
        if pad < 0:  # validation refuses --attention-backend flash so; auto may pick it
            raise ConfigError(f"flash-attn pads V's heads ({v.shape[-1]}) to Q/K's "
                              f"({q.shape[-1]}), which must not be narrower: use "
                              "--attention-backend sdpa")
        return kernel(q, k, F.pad(v, (0, pad)), *args)[..., :v.shape[-1]]
    return run


# flex without documents: the causal mask is SDPA's own.
_KERNELS = {"flash": _padded_value(_flash),  # gpu_check: multi_latent_attention
            "sdpa": _sdpa, "unfused": _unfused, "flex": _sdpa}


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str,
                   dropout_p: float = 0.0, softmax_scale: float | None = None,
                   documents: Documents | None = None) -> torch.Tensor:
    """Causal attention. q, k: [b, s_q, heads, d], [b, s_k, kv_heads, d] with heads a
    multiple of kv_heads and s_q <= s_k; v: [b, s_k, kv_heads, d_v] (d_v <= d: multi-latent
    attention's); returns [b, s_q, heads, d_v]. `backend` is a
    resolved one (see resolve_backend); softmax_scale defaults to 1/sqrt(d). `documents`:
    those of q's rows, the keys being global positions 0..s_k-1; attention is then
    block-causal (module docstring)."""
    if backend not in _KERNELS:
        raise ValueError(f"backend {backend!r} is not one of {tuple(_KERNELS)}; "
                         "pass the result of resolve_backend()")
    scale = checked_scale(q, k, softmax_scale)
    if documents is not None:
        return _document_attention(q, k, v, documents, backend, dropout_p, scale)
    return _KERNELS[backend](q, k, v, dropout_p, scale)


# Not traced by a compiled layer: the documents differ per micro-batch, and dynamo would
# guard on them (a recompile each time); the kernels inside are compiled or fused anyway.
@torch.compiler.disable
def _document_attention(q, k, v, documents: Documents, backend: str, dropout_p: float,
                        scale: float) -> torch.Tensor:
    if backend == "unfused":
        visible = documents.visible(torch.arange(k.shape[1], device=q.device))
        return _unfused(q, k, v, dropout_p, scale, hidden=~visible[:, None])
    if backend == "flash":  # gpu_check: multi_latent_attention
        return _padded_value(_flash_varlen)(q, k, v, documents, dropout_p, scale)
    if backend == "flex":
        return _flex(q, k, v, documents, dropout_p, scale)
    return _padded_documents(q, k, v, documents, dropout_p, scale)


def _padded_documents(q, k, v, documents: Documents, dropout_p, scale):
    """SDPA over the documents as padded batches, one causal call per length bucket
    (Documents.padded_batches): the work is that of the documents, padded by at most a
    third a side; one call per document would cost a kernel's overhead per document, more
    than its work at CPU sizes of a few hundred rows."""
    b, s_q, heads = q.shape[:3]
    plan = documents.padded_batches(k.shape[1])
    sizes = [n * length for n, length in plan.shapes]
    q_all = gather_rows(q.flatten(0, 1), plan.queries).split(sizes)
    k_all, v_all = (gather_rows(t.flatten(0, 1), plan.keys).split(sizes) for t in (k, v))
    outs = [_sdpa(*(t.view(n, length, *t.shape[1:]) for t in batch), dropout_p, scale)
            for (n, length), *batch in zip(plan.shapes, q_all, k_all, v_all)]
    out = gather_rows(torch.cat([o.flatten(0, 1) for o in outs]), plan.outputs)
    return out.view(b, s_q, heads, v.shape[-1])


# gpu_check: document_attention
def _flash_varlen(q, k, v, documents: Documents, dropout_p, scale):
    """flash-attn's varlen kernel on the documents' boundaries: the rows of every sample as
    one packed sequence, cu_seqlens of the queries and of the keys they see."""
    from flash_attn import flash_attn_varlen_func

    b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
    key = ("varlen", s_q, s_k)
    if key not in documents.cache:
        runs = [(i, r) for i, sample in enumerate(documents.runs()) for r in sample]
        rows = [r.row_end - r.row_begin for _, r in runs]
        keys = [r.key_end - r.key_begin for _, r in runs]
        index = torch.cat([torch.arange(i * s_k + r.key_begin, i * s_k + r.key_end)
                           for i, r in runs]).to(q.device)
        cu = [torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=q.device)
              for n in (rows, keys)]
        documents.cache[key] = (index, *cu, max(rows), max(keys))
    index, cu_q, cu_k, max_q, max_k = documents.cache[key]
    k, v = (t.flatten(0, 1).index_select(0, index) for t in (k, v))
    out = flash_attn_varlen_func(q.flatten(0, 1), k, v, cu_q, cu_k, max_q, max_k,
                                 dropout_p=dropout_p, softmax_scale=scale, causal=True)
    return out.view(b, s_q, *out.shape[1:])


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


# gpu_check: document_attention
def _flex(q, k, v, documents: Documents, dropout_p, scale):
    """FlexAttention with a block mask of the documents (built once per forward)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout_p:
        raise ValueError("FlexAttention has no attention dropout (validation refuses it)")
    b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
    key = ("flex", s_q, s_k)
    if key not in documents.cache:
        starts, shift = documents.starts, s_k - s_q

        def same_document_causal(batch, head, row, col):
            return (starts[batch, row] <= col) & (col <= row + shift)

        documents.cache[key] = create_block_mask(same_document_causal, b, None, s_q, s_k,
                                                 device=q.device)
    out = _compiled_flex_attention()(*(t.transpose(1, 2) for t in (q, k, v)),
                                     block_mask=documents.cache[key], scale=scale,
                                     enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def checked_scale(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None) -> float:
    """softmax_scale, default 1/sqrt(d), once q's heads are checked to be a multiple of k's."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads is not a multiple of "
                         f"{k.shape[2]} key/value heads")
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
