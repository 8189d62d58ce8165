"""Attention backends: every backend this machine can run equals the unfused reference,
which itself equals the closed form written out one query position at a time."""

import math

import pytest
import torch

from megalite.errors import ConfigError
from megalite.attention_backends import (
    core_attention, flash_attn_available, resolve_backend)

HAS_GPU = torch.accelerator.is_available()
HAS_FLASH = HAS_GPU and flash_attn_available()
BACKENDS = [
    "sdpa",
    pytest.param("flash", marks=pytest.mark.skipif(
        not HAS_FLASH, reason="flash-attn needs a GPU and the flash-attn package")),
]


def qkv(seq, heads, kv_heads, *, batch=2, dim=8, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq, heads, dim)] + 2 * [(batch, seq, kv_heads, dim)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def forward_backward(backend, q, k, v, **kwargs):
    out = core_attention(q, k, v, backend=backend, **kwargs)
    # A fixed random upstream gradient so every element of out matters to the grads.
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    q.grad = k.grad = v.grad = None
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("seq", [1, 7, 64, 257])
def test_backend_matches_unfused(backend, kv_heads, seq):
    if backend == "flash":  # flash-attn has no fp32 kernels; compare in bf16 on the GPU
        q, k, v = qkv(seq, 4, kv_heads, dtype=torch.bfloat16,
                      device=torch.accelerator.current_accelerator())
        tol = dict(rtol=2e-2, atol=2e-2)
    else:
        q, k, v = qkv(seq, 4, kv_heads)
        tol = dict(rtol=1e-5, atol=1e-5)
    got = forward_backward(backend, q, k, v)
    want = forward_backward("unfused", q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", [*BACKENDS, "unfused"])
@pytest.mark.parametrize("q_len", [1, 3, 7])
def test_query_shorter_than_keys_is_the_last_rows(backend, q_len):
    """A query of the last q_len positions (generation with a KV cache) sees what those
    rows of the full causal attention see: causal aligned to the lower right."""
    if backend == "flash":
        q, k, v = (t.detach() for t in qkv(9, 4, 2, dtype=torch.bfloat16,
                                           device=torch.accelerator.current_accelerator()))
        tol = dict(rtol=2e-2, atol=2e-2)
    else:
        q, k, v = (t.detach() for t in qkv(9, 4, 2))
        tol = dict(rtol=1e-5, atol=1e-5)
    want = core_attention(q, k, v, backend="unfused")[:, -q_len:]
    got = core_attention(q[:, -q_len:], k, v, backend=backend)
    torch.testing.assert_close(got, want, **tol)


def test_sdpa_honours_softmax_scale():
    q, k, v = qkv(16, 4, 2)
    for backend in ("sdpa", "unfused"):
        default = core_attention(q, k, v, backend=backend)
        explicit = core_attention(q, k, v, backend=backend, softmax_scale=1 / math.sqrt(8))
        torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    got = core_attention(q, k, v, backend="sdpa", softmax_scale=0.3)
    want = core_attention(q, k, v, backend="unfused", softmax_scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, default)


def test_unfused_equals_per_position_closed_form():
    """out[t] = sum_{j<=t} softmax_j(q_t . k_j / sqrt(d)) v_j, with query head i reading
    K/V head i // (heads / kv_heads); written as plain loops in float64."""
    batch, seq, heads, kv_heads, dim = 2, 5, 4, 2, 3
    q, k, v = (t.detach().double() for t in qkv(seq, heads, kv_heads, batch=batch, dim=dim))
    out = core_attention(q, k, v, backend="unfused")
    for b in range(batch):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            for t in range(seq):
                w = [math.exp(float(q[b, t, h] @ k[b, j, kv]) / math.sqrt(dim))
                     for j in range(t + 1)]
                want = sum(w[j] * v[b, j, kv] for j in range(t + 1)) / sum(w)
                torch.testing.assert_close(out[b, t, h], want, rtol=1e-12, atol=1e-12)


def test_sdpa_bf16_on_cpu_within_rounding_of_unfused():
    """Each output is a convex combination of v rows. bf16 keeps 8 significant bits, so
    rounding to it costs at most u = 2^-8 relative. Per backend: rounding the
    probabilities before P @ V moves the output by <= u * max|v|, rounding the output
    by <= u * |out| <= u * max|v|; fp32 accumulation is negligible. The two backends
    therefore differ by at most 4 u max|v|."""
    q, k, v = (t.detach() for t in qkv(257, 4, 2, dtype=torch.bfloat16))
    got = core_attention(q, k, v, backend="sdpa")
    want = core_attention(q, k, v, backend="unfused")
    assert got.dtype == torch.bfloat16
    bound = 4 * 2**-8 * v.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= bound


def test_sdpa_does_not_repeat_kv(monkeypatch):
    """GQA must not materialise repeated K/V where the kernel takes grouped heads."""
    def refuse(*args, **kwargs):
        raise AssertionError("sdpa repeated K/V")
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "expand", refuse)
    q, k, v = qkv(7, 4, 1)
    assert core_attention(q, k, v, backend="sdpa").shape == q.shape


def test_resolve_backend_on_cpu():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_backend("auto", cpu, dtype) == "sdpa"
        assert resolve_backend("sdpa", cpu, dtype) == "sdpa"
        assert resolve_backend("unfused", cpu, dtype) == "unfused"
        with pytest.raises(ConfigError, match=r"--attention-backend flash.*--use-flash-attn"):
            resolve_backend("flash", cpu, dtype)
    with pytest.raises(ConfigError, match="--attention-backend fused"):
        resolve_backend("fused", cpu, torch.float32)


@pytest.mark.skipif(flash_attn_available(), reason="flash-attn is installed here")
def test_flash_error_says_how_to_install():
    with pytest.raises(ConfigError, match="pip install flash-attn"):
        resolve_backend("flash", torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not HAS_FLASH, reason="flash-attn needs a GPU and the flash-attn package")
def test_resolve_backend_with_flash():
    gpu = torch.accelerator.current_accelerator()
    assert resolve_backend("auto", gpu, torch.bfloat16) == "flash"
    assert resolve_backend("auto", gpu, torch.float32) == "sdpa"
    with pytest.raises(ConfigError, match="needs --bf16 or --fp16"):
        resolve_backend("flash", gpu, torch.float32)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_backend("flash", torch.device("cpu"), torch.bfloat16)


def test_core_attention_rejects_unresolved_backend_and_bad_groups():
    q, k, v = qkv(4, 4, 2)
    with pytest.raises(ValueError, match="resolve_backend"):
        core_attention(q, k, v, backend="auto")
    q3, _, _ = qkv(4, 3, 2)
    with pytest.raises(ValueError, match="multiple"):
        core_attention(q3, k, v, backend="sdpa")
