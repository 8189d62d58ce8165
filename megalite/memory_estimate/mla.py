"""What multi-latent attention (model/mla.py) and QK-norm save for backward per micro-batch
(docs/memory.md, "Multi-latent attention"). Letters as activations.py's: T rows of the
[s, b, .] activations this rank computes on (s / CP x b), R the residual stream's (T / TP
under SP), a bytes per element; per TP rank n heads, the q/k head d = qk_head_dim +
qk_pos_emb_head_dim, the v head d_v; ranks r_q, r_kv of the latents, r the RoPE part.

- The down-projections read the norm output at R rows: one [R, h] (the attention's input;
  without a query latent under SP, linear_q_proj keeps its gathered [T, h] as well).
- Each latent: the down-projection's output [R, rank (+ r for the key/value one)] kept by
  what reads it (the latent norm, or the up-projection's input without SP); with
  --qk-layernorm the norm's own (activations.norm_saved_bytes at the latent's width) and
  its output as the up-projection's input ([T, rank] gathered under SP).
- Q and K [T, n, d], new tensors (the RoPE part concatenated to the rest), and V, a view
  that keeps the key/value up-projection's output [T, n (qk_head_dim + d_v)] alive.
- The kernel's state (activations.core_attention_bytes with V's width) unless selective
  recompute drops it, the output projection's input [T, n d_v], the residual dropout's mask.
"""

import dataclasses

from megalite.config import Config


def mla_saved_bytes(config: Config, shape, selective: bool, norm_saved_bytes,
                    core_attention_bytes) -> int:
    """Multi-latent attention after its norm, its input included (module docstring);
    `norm_saved_bytes`, `core_attention_bytes`: activations.py's (passed: that module
    imports this one)."""
    m, a = config.model, shape.act_bytes
    rows, tokens, heads = shape.residual_tokens, shape.tokens, shape.heads
    total = a * rows * shape.hidden
    if m.q_lora_rank is None:
        total += a * tokens * shape.hidden if m.sequence_parallel else 0
    else:
        total += _latent_bytes(config, shape, m.q_lora_rank, 0, norm_saved_bytes)
    total += _latent_bytes(config, shape, m.kv_lora_rank, m.qk_pos_emb_head_dim,
                           norm_saved_bytes)
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    q_and_k, kv = (a * tokens * heads * 2 * q_head,
                   a * tokens * heads * (m.qk_head_dim + m.v_head_dim))
    own = None if selective else _own_operands_bytes(config, shape, core_attention_bytes)
    if own is None:
        kernel = 0 if selective else _kernel_bytes(config, shape, core_attention_bytes)
        own = q_and_k + kv + kernel
    total += own + a * tokens * heads * m.v_head_dim  # + the output projection's input
    return total + shape.mask(m.hidden_dropout) * rows * shape.hidden


def _own_operands_bytes(config: Config, shape, core_attention_bytes) -> int | None:
    """The kernels that keep their own copies of Q and K (as bmm operands, in fp32) and
    the s x s probabilities instead of Q and K themselves (None for the others): unfused
    (attention_backends._unfused: the probabilities, mask and dropout's as
    core_attention_bytes counts them, with no repeated K and V of Q's width: V itself
    instead), and the CPU's SDPA for unequal head sizes, which falls back to its math
    kernel (its flash kernel refuses them; bf16 inputs upcast, V too, fp32 V kept itself)."""
    m, heads, tokens = config.model, shape.heads, shape.tokens
    if shape.cp > 1 or m.masks_documents:
        return None
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    q_and_k = 4 * tokens * heads * 2 * q_head
    v = tokens * heads * m.v_head_dim
    if m.attention_backend == "unfused":
        probs = core_attention_bytes(config, dataclasses.replace(shape, query_width=0))
        return q_and_k + shape.act_bytes * v + probs
    if (m.attention_backend in ("sdpa", "auto") and not shape.device.sdpa_takes_unequal_heads
            and q_head != m.v_head_dim):
        probs = shape.micro_batch * heads * shape.seq * shape.seq
        kv = shape.act_bytes * tokens * heads * (m.qk_head_dim + m.v_head_dim)
        return q_and_k + 4 * probs + (4 * v if shape.mixed else kv)
    return None


def _kernel_bytes(config: Config, shape, core_attention_bytes) -> int:
    """The attention kernel's state beyond Q, K, V: core_attention_bytes at the output's
    width (V's; flash-attn's padded V: Q's), unfused repeating K and V, (d + d_v) / 2 each
    on average."""
    m, heads = config.model, shape.heads
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    width = {"unfused": heads * (q_head + m.v_head_dim) // 2,
             "flash": heads * q_head}.get(m.attention_backend, heads * m.v_head_dim)
    return core_attention_bytes(config, dataclasses.replace(shape, query_width=width))


def _latent_bytes(config: Config, shape, rank: int, rope: int, norm_saved_bytes) -> int:
    m, a = config.model, shape.act_bytes
    rows, tokens = shape.residual_tokens, shape.tokens
    down = a * rows * (rank + rope)
    gathered = a * tokens * rank if m.sequence_parallel else 0
    if not m.qk_layernorm:
        # The up-projection keeps the down-projection's output (a view of it without SP),
        # or the gathered latent under SP.
        return gathered or down
    norm, keeps_input = _norm_beyond_input(config, shape, rank, rows, norm_saved_bytes)
    return (down if keeps_input else 0) + norm + (gathered or a * rows * rank)


def _norm_beyond_input(config: Config, shape, width: int, rows: int, norm_saved_bytes):
    """(a norm's saved bytes beyond its input tensor, whether it keeps that input tensor
    itself): an fp32 RMSNorm and a LayerNorm do (their producer's tensor, counted there);
    RMSNorm on lower-precision input keeps its own fp32 copy (counted here)."""
    norm = norm_saved_bytes(config, shape, width=width, rows=rows)
    if config.model.normalization != "RMSNorm":
        return norm - shape.act_bytes * rows * width, True
    if shape.act_bytes == 4:
        return norm - 4 * rows * width, True
    return norm, False


def qk_norm_saved_bytes(config: Config, shape, norm_saved_bytes) -> int:
    """--qk-layernorm without MLA: the per-head norms of Q [T, q] and K [T, k], each
    norm_saved_bytes over T x heads rows of kv_channels beyond its input (a view of the
    fused QKV output, counted with it, but for Q's copy under GQA); their outputs are what
    RoPE reads, whose copies activations.qkv_saved_bytes counts."""
    m = config.model
    if not m.qk_layernorm or m.multi_latent_attention:
        return 0
    total = 0
    for width in (shape.query_width, shape.kv_width):
        rows = shape.tokens * width // m.kv_channels
        norm, keeps_input = _norm_beyond_input(config, shape, m.kv_channels, rows,
                                               norm_saved_bytes)
        # Under GQA Q's heads are no view of the fused output: their reshape copies them.
        copied = width == shape.query_width and m.num_query_groups != m.num_attention_heads
        total += norm + (shape.act_bytes * shape.tokens * width if copied and keeps_input
                         else 0)
    return total
