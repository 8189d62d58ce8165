"""Multi-latent attention's GPU paths (docs/design.md §32) against the fp32 reference.

MLA's V heads are narrower than its Q/K heads, which every kernel must take:
- core_attention per backend: sdpa (CUDA: the memory-efficient kernel), flash (flash-attn,
  V zero-padded to Q's head size; skipped where not installed), with and without document
  masks (flash: the varlen kernel, padded V too);
- the ring's fused blocks (torch's CUDA flash kernel, V padded per block), CP 2 emulated in
  one process as benchmarks/gpu/ring_attention.py does;
- a whole MLA model (query latent, latent norms, YaRN) in bf16: loss and gradients of the
  sdpa and flash backends against unfused.
Reference: the unfused kernel in fp32 on the same inputs. Tolerance: bf16's rounding step
relative to the largest reference value (5% for the whole bf16 model's gradients), 1e-5 in
fp32 under SMOKE (CPU; flash skipped there).
"""

import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.ring_emulation import emulated_ring
from benchmarks.gpu.runs import GPU, Checks
from megalite.attention_backends import core_attention, flash_attn_available
from megalite.config import GPTConfig
from megalite.context_parallel import fused_blocks
from megalite.documents import Documents
from megalite.model.gpt import GPTModel

DEVICE = torch.device("cuda", 0) if GPU else torch.device("cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
FLOOR = 2 ** -8 if GPU else 1e-5
# [batch, seq, heads, q/k head, v head]: DeepSeek-V3's heads (192, 128) on a GPU.
B, S, H, DQ, DV = (2, 1024, 16, 192, 128) if GPU else (2, 64, 4, 24, 16)
BACKENDS = ["sdpa"] + (["flash"] if GPU and flash_attn_available() else [])


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, H, DQ, generator=g) for _ in range(2))
    v, dout = (torch.randn(B, S, H, DV, generator=g) for _ in range(2))
    return [t.to(DEVICE) for t in (q, k, v, dout)]


def attention(backend, q, k, v, dout, dtype, documents=None):
    q, k, v = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))
    out = core_attention(q, k, v, backend=backend, documents=documents)
    out.backward(dout.to(dtype))
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def close(got, ref, floor=FLOOR) -> tuple[bool, str]:
    errors = [((x - y).abs().max() / y.abs().max()).item() for x, y in zip(got, ref)]
    return all(e <= floor for e in errors), ", ".join(f"{e:.1e}" for e in errors)


def model_grads(backend):
    config = GPTConfig(
        num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
        num_query_groups=4, kv_channels=DQ, seq_length=S, max_position_embeddings=S,
        padded_vocab_size=512,
        attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, position_embedding_type="none", multi_latent_attention=True,
        q_lora_rank=96, kv_lora_rank=64, qk_head_dim=DQ - 64 if GPU else 16,
        qk_pos_emb_head_dim=64 if GPU else 8, v_head_dim=DV, qk_layernorm=True,
        rope_type="yarn", rotary_scaling_factor=4.0, mscale_all_dim=1.0,
        yarn_original_max_position_embeddings=S // 4, attention_backend=backend)
    model = GPTModel(config, seed=0).to(DEVICE, DTYPE if backend != "unfused" else torch.float32)
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    loss = model(tokens, labels=tokens).float().mean()
    loss.backward()
    return [loss.detach()[None]] + [p.grad.float() for p in model.parameters()]


def main():
    check = Checks()
    print(f">> {DEVICE.type}, {DTYPE}; q/k head {DQ}, v head {DV}; backends {BACKENDS}; "
          f"error = max |x - fp32 unfused| / max |fp32 unfused| per tensor (out, dq, dk, dv)")
    q, k, v, dout = inputs()
    starts = torch.tensor([0] * (S // 3) + [S // 3] * (S - S // 3)).expand(B, S).to(DEVICE)
    for documents in (None, Documents(starts, torch.arange(S, device=DEVICE))):
        ref = attention("unfused", q, k, v, dout, torch.float32, documents)
        for backend in BACKENDS:
            ok, detail = close(attention(backend, q, k, v, dout, DTYPE, documents), ref)
            check(f"{backend}{' documents' if documents else ''}", ok, detail)
    reason = fused_blocks.unavailable_reason(DEVICE, DTYPE, DQ)
    if check("ring fused blocks available", reason is None, reason or "taken"):
        ok, detail = close(emulated_ring(2, *(t.to(DTYPE) for t in (q, k, v, dout))), attention("unfused", q, k, v, dout,
                                                                   torch.float32))
        check("CP 2 ring, fused blocks, V padded", ok, detail)
    ref = model_grads("unfused")
    for backend in BACKENDS:
        ok, detail = close(model_grads(backend), ref, floor=0.05 if GPU else 1e-5)
        errors = [float(e) for e in detail.split(", ")]
        check(f"MLA model, {backend}: loss and grads", ok,
              f"loss {errors[0]:.1e}, worst grad {max(errors[1:]):.1e}")
    check.exit()


if __name__ == "__main__":
    main()
