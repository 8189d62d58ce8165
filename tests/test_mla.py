"""Multi-latent attention (megalite/model/mla.py, validation/mla.py) in one process.

Megatron's own logits are test_megatron_mla.py's reference (query latent, latent norms,
YaRN). Here: the variant without a query latent and with plain RoPE against DeepSeek's
equations written out with DeepSeek's complex-number RoPE on interleaved pairs; every
backend (and the document-masked ones) with K and V head sizes apart; the bad settings
refused by name.
"""

import dataclasses
import math
import re

import pytest
import torch

from megalite.arguments import parse_args
from megalite.documents import Documents
from megalite.errors import ConfigError
from megalite.hf_convert import hf_config_and_state_dict
from megalite.model.gpt import GPTModel
from megalite.training_log import num_floating_point_operations
from megalite.validation import validate_model_args

from tests.helpers import LLAMA_STYLE, tiny_gpt_config

MLA = dict(LLAMA_STYLE, multi_latent_attention=True, position_embedding_type="none",
           kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, kv_channels=12)


def mla_config(**overrides):
    return tiny_gpt_config(**{**MLA, **overrides})


def deepseek_attention(attention, x: torch.Tensor, base: float) -> torch.Tensor:
    """DeepSeek-V2 §2.1 (its MLA code's order): no query latent, no latent norms, plain RoPE
    on interleaved channel pairs as complex numbers; x [s, b, h]."""
    c = attention.config
    s, b, _ = x.shape
    n, dn, dr, dv = c.num_attention_heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    q = (x @ attention.linear_q_proj.weight.T).view(s, b, n, dn + dr)
    latent, k_pe = (x @ attention.linear_kv_down_proj.weight.T).split([c.kv_lora_rank, dr], -1)
    kv = (latent @ attention.linear_kv_up_proj.weight.T).view(s, b, n, dn + dv)
    freqs = 1.0 / base ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    turn = torch.polar(torch.ones(s, dr // 2, dtype=torch.float64),
                       torch.outer(torch.arange(s, dtype=torch.float64), freqs))

    def rope(t):  # [s, b, heads, dr]: pairs (2i, 2i+1) as complex numbers
        z = torch.view_as_complex(t.double().unflatten(-1, (-1, 2)))
        return torch.view_as_real(z * turn[:, None, None]).flatten(-2)

    q = torch.cat([q[..., :dn].double(), rope(q[..., dn:])], -1)
    k = torch.cat([kv[..., :dn].double(), rope(k_pe[:, :, None]).expand(s, b, n, dr)], -1)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(dn + dr)
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), kv[..., dn:].double())
    return out.reshape(s, b, n * dv).float() @ attention.linear_proj.weight.T


def test_mla_without_query_latent_is_deepseeks_equations():
    config = mla_config(rope_type="rope", attention_backend="unfused")
    model = GPTModel(config, seed=1)
    attention = model.decoder.layers["0"].self_attention
    assert not hasattr(attention, "linear_q_down_proj") and not hasattr(attention, "kv_layernorm")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # scores of order 1, so that RoPE's pairing shows in the softmax
        for param in attention.parameters():
            param.normal_(0, 0.3, generator=generator)
    x = torch.randn(8, 2, 32, generator=generator)
    got = attention(x, model.rope_table(x.device))
    torch.testing.assert_close(got, deepseek_attention(attention, x, config.rotary_base),
                               atol=1e-5, rtol=0)


def _documents(batch: int, seq: int) -> Documents:
    starts = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 7], [0, 0, 2, 2, 2, 2, 2, 2]])[:batch, :seq]
    return Documents(starts, torch.arange(seq))


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_sdpa_equals_the_unfused_reference_with_v_head_dim_apart(documents):
    """q/k heads of 12, v heads of 6: sdpa (and its padded document batches) as unfused,
    forward and gradients."""
    config = mla_config(q_lora_rank=16, qk_layernorm=True, rotary_scaling_factor=4.0,
                        mscale_all_dim=1.0, yarn_original_max_position_embeddings=4,
                        rope_type="yarn")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for backend in ("unfused", "sdpa"):
        model = GPTModel(dataclasses.replace(config, attention_backend=backend,
                                             reset_attention_mask=documents), seed=2)
        starts = _documents(2, 8).starts if documents else None
        loss = model(tokens, labels=tokens, document_starts=starts).mean()
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss_u, grads_u), (loss_s, grads_s) = results
    torch.testing.assert_close(loss_s, loss_u, atol=1e-6, rtol=0)
    for name, grad in grads_u.items():
        torch.testing.assert_close(grads_s[name], grad, atol=1e-6, rtol=1e-5, msg=name)


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--vocab-size 128 --mock-data --multi-latent-attention --position-embedding-type none "
        "--kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16")


@pytest.mark.parametrize("extra, message", [
    ("--qk-pos-emb-head-dim 7", "--qk-pos-emb-head-dim must be even, got 7"),
    ("--q-lora-rank 64", "--q-lora-rank=64: a latent of rank at least --hidden-size=64"),
    ("--kv-lora-rank 0", "--kv-lora-rank must be positive, got 0"),
    ("--group-query-attention --num-query-groups 2", "--group-query-attention are mutually"),
    ("--kv-channels 16", "--kv-channels=16 with --multi-latent-attention"),
    ("--position-embedding-type learned_absolute", "learned_absolute (the default) with"),
    ("--rope-type rope --mscale 0.5", "--mscale=0.5: YaRN's flags need"),
    ("--attention-backend flex", "--attention-backend flex with --multi-latent-attention"),
    ("--use-flash-attn --v-head-dim 32", "at least --v-head-dim=32"),
    ("--fp8-format e4m3", "--fp8-format e4m3 with --multi-latent-attention"),
    ("--rotary-percent 0.5", "--rotary-percent=0.5 with --multi-latent-attention"),
    ("--tensor-model-parallel-size 3", "must divide --num-attention-heads=4"),
], ids=lambda v: v if v.startswith("--") else None)
def test_bad_settings_are_refused_by_name(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_model_args(parse_args(f"{BASE} {extra}".split()), world_size=3)


@pytest.mark.parametrize("flags, message", [
    ("--rope-type yarn", "--rope-type yarn applies to --multi-latent-attention only"),
    ("--rotary-scaling-factor 40", "--rotary-scaling-factor=40.0: YaRN's flags need"),
])
def test_yarn_flags_without_mla_are_refused(flags, message):
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 " \
           "--vocab-size 128 --mock-data --position-embedding-type rope "
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_model_args(parse_args((base + flags).split()))


def test_megatrons_defaults_make_a_yarn_model():
    config = validate_model_args(parse_args(BASE.split())).model
    assert (config.rope_type, config.rotary_scaling_factor, config.q_lora_rank) == \
        ("yarn", 1.0, None)
    # YaRN at factor 1 is plain RoPE: Megatron's default MLA is unscaled.
    rope = GPTModel(dataclasses.replace(config, rope_type="rope"), seed=0)
    yarn = GPTModel(config, seed=0)
    torch.testing.assert_close(yarn.rope_table(torch.device("cpu")),
                               rope.rope_table(torch.device("cpu")), atol=0, rtol=0)


def test_flops_are_megatrons_mla_count():
    """num_floating_point_operations with MLA: Megatron's training.py count (its
    transformer_flops, MLA branch) for this model, written out: per token and layer
    6 x [q_lora (h + n (dn + dr) + 1) + kv_lora (h + n (dn + dv) + 1) + h dr + n dv h]
    + 6 x s x (n (dn + dr) / 2 + n dv / 2), plus the MLP's 6 x 3 h f (SwiGLU) and the logits'
    6 h V once."""
    config = mla_config(q_lora_rank=16)
    h, n, s, f, vocab = 32, 4, 8, 64, 64
    dn, dr, dv, q_lora, kv_lora = 8, 4, 6, 16, 12
    attention = 6 * (q_lora * (h + n * (dn + dr) + 1) + kv_lora * (h + n * (dn + dv) + 1)
                     + h * dr + n * dv * h) + 6 * s * (n * (dn + dr) / 2 + n * dv / 2)
    per_token = 2 * (attention + 6 * 3 * h * f) + 6 * h * vocab
    assert num_floating_point_operations(config, 3) == pytest.approx(3 * s * per_token,
                                                                     rel=1e-12)
    without_latent = dataclasses.replace(config, q_lora_rank=None)
    attention_q = attention - 6 * q_lora * (h + n * (dn + dr) + 1) + 6 * h * n * (dn + dr)
    assert num_floating_point_operations(without_latent, 1) == pytest.approx(
        s * (2 * (attention_q + 6 * 3 * h * f) + 6 * h * vocab), rel=1e-12)


def test_huggingface_export_without_latent_norms_is_refused_by_name():
    """DeepseekV3ForCausalLM always has its latent norms (hf_deepseek.py; the round trip and
    generation are tests/test_hf_deepseek.py's and tests/test_generate.py's)."""
    model = GPTModel(mla_config(), seed=0).eval()
    with pytest.raises(ConfigError, match="qk_layernorm=False"):
        hf_config_and_state_dict(model.config, model.state_dict())
