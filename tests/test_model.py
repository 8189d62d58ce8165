"""The GPT model against closed forms and explicit reference computations."""

import math

import pytest
import torch
import torch.nn.functional as F

from megalite.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.init import initial_value
from megalite.model.rotary import apply_rotary, rotary_frequencies, rotary_table
from megalite.pipeline_parallel.stages import Stage
from megalite.tensor_parallel.params import single_process_name

from tests.helpers import tiny_gpt_config

SIZES = dict(hidden_size=64, ffn_hidden_size=256, kv_channels=16, seq_length=16,
             padded_vocab_size=128)


def make_config(**kw) -> GPTConfig:
    return tiny_gpt_config(**{**SIZES, **kw})


def closed_form_parameter_count(c: GPTConfig) -> int:
    h, L, V, f = c.hidden_size, c.num_layers, c.padded_vocab_size, c.ffn_hidden_size
    q, kv = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    bias = 1 if c.add_bias_linear else 0
    norm = 2 * h if c.normalization == "LayerNorm" else h
    attention = h * (q + 2 * kv) + bias * (q + 2 * kv) + q * h + bias * h
    up_projections = 2 if c.swiglu else 1
    mlp = up_projections * (h * f + bias * f) + f * h + bias * h
    embeddings = V * h + (c.max_position_embeddings * h
                          if c.position_embedding_type == "learned_absolute" else 0)
    output = V * h if c.untie_embeddings_and_output_weights else 0
    qk_norms = 2 * norm // h * c.kv_channels if c.qk_layernorm else 0
    return embeddings + L * (2 * norm + qk_norms + attention + mlp) + norm + output


@pytest.mark.parametrize("kw", [
    {},
    dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope"),
    dict(num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True),
    dict(qk_layernorm=True), dict(qk_layernorm=True, normalization="RMSNorm"),
    dict(num_query_groups=1, kv_channels=8, num_layers=3, ffn_hidden_size=96,
         max_position_embeddings=64),
])
def test_parameter_count_closed_form(kw):
    c = make_config(**kw)
    model = GPTModel(c, seed=1)
    assert sum(p.numel() for p in model.parameters()) == closed_form_parameter_count(c)


def reference_attention(layer, x, config, transform_qk=lambda q, k: (q, k)):
    """softmax(QK^T / sqrt(d) + causal mask) V, with each K/V head repeated over its
    query group, computed explicitly from the layer's weights (Megatron's per-group
    [q..., k, v] row layout of the fused QKV weight); `transform_qk` maps the query heads
    [s, b, n, d] and K heads [s, b, g, d] before attention."""
    s, b, _ = x.shape
    n, g, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    qkv = (x @ layer.linear_qkv.weight.t() + layer.linear_qkv.bias).view(s, b, g, n // g + 2, d)
    q, k = transform_qk(qkv[:, :, :, : n // g].reshape(s, b, n, d), qkv[:, :, :, -2])
    k = k.repeat_interleave(n // g, dim=2)
    v = qkv[:, :, :, -1].repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -math.inf)
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * d)
    return out @ layer.linear_proj.weight.t() + layer.linear_proj.bias


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_attention_matches_explicit_reference(groups):
    c = make_config(num_query_groups=groups)
    layer = GPTModel(c, seed=3).decoder.layers["0"].self_attention
    torch.nn.init.normal_(layer.linear_qkv.bias)  # biases start at 0; exercise them
    x = torch.randn(16, 3, 64)
    torch.testing.assert_close(layer(x, None), reference_attention(layer, x, c),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [4, 2])
def test_qk_layernorm_matches_explicit_reference(groups):
    """--qk-layernorm: each head's q and k times rsqrt(mean of squares + eps) times one
    weight of kv_channels shared by all heads, before RoPE (random weights: a norm after
    RoPE, or a weight per head, would differ)."""
    c = make_config(num_query_groups=groups, qk_layernorm=True, normalization="RMSNorm",
                    norm_epsilon=1e-3, position_embedding_type="rope")
    model = GPTModel(c, seed=3)
    layer = model.decoder.layers["0"].self_attention
    assert layer.q_layernorm.weight.shape == layer.k_layernorm.weight.shape == (16,)
    with torch.no_grad():
        for p in (layer.linear_qkv.bias, layer.q_layernorm.weight, layer.k_layernorm.weight):
            p.normal_()
    x, table = torch.randn(16, 3, 64), model.rope_table(torch.device("cpu"))

    def normalise_then_rotate(q, k):
        q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-3) * norm.weight
                for t, norm in ((q, layer.q_layernorm), (k, layer.k_layernorm)))
        return apply_rotary(q, table[:16]), apply_rotary(k, table[:16])

    torch.testing.assert_close(layer(x, table),
                               reference_attention(layer, x, c, normalise_then_rotate),
                               rtol=1e-5, atol=1e-5)


def test_rotary_closed_form():
    """Channel pair (i, i + d/2) at position m is rotated by angle m * base^(-2i/d)."""
    s, d, base = 5, 8, 10000
    x = torch.randn(s, 2, 3, d)
    y = apply_rotary(x, rotary_table(rotary_frequencies(s, d, base)))
    for m in range(s):
        for i in range(d // 2):
            theta = m * base ** (-2 * i / d)
            a, b = x[m, ..., i], x[m, ..., i + d // 2]
            torch.testing.assert_close(y[m, ..., i], a * math.cos(theta) - b * math.sin(theta))
            torch.testing.assert_close(y[m, ..., i + d // 2],
                                       b * math.cos(theta) + a * math.sin(theta))


def test_rotary_partial_leaves_the_rest():
    x = torch.randn(4, 1, 2, 8)
    y = apply_rotary(x, rotary_table(rotary_frequencies(4, 4, 10000)))
    assert torch.equal(y[..., 4:], x[..., 4:])


def test_initialisation_by_name_not_construction_order():
    c = make_config()
    torch.manual_seed(0)
    a = GPTModel(c, seed=7)
    torch.manual_seed(99)
    torch.randn(1000)
    b = GPTModel(c, seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(GPTModel(c, seed=8).embedding.word_embeddings.weight,
                           a.embedding.word_embeddings.weight)
    # Two layers of the same shape get different values.
    assert not torch.equal(a.decoder.layers["0"].mlp.linear_fc1.weight,
                           a.decoder.layers["1"].mlp.linear_fc1.weight)


def test_initial_statistics():
    c = make_config(num_layers=8, hidden_size=256, ffn_hidden_size=1024, kv_channels=64)
    std = c.init_method_std
    fc1 = initial_value("decoder.layers.3.mlp.linear_fc1.weight", (1024, 256), c, 1)
    fc2 = initial_value("decoder.layers.3.mlp.linear_fc2.weight", (256, 1024), c, 1)
    assert abs(fc1.std().item() - std) < 0.02 * std
    assert abs(fc2.std().item() - std / math.sqrt(16)) < 0.02 * std / 4
    assert torch.equal(initial_value("x.bias", (4,), c, 1), torch.zeros(4))
    assert torch.equal(initial_value("decoder.final_layernorm.weight", (4,), c, 1), torch.ones(4))


def test_tied_output_layer_is_the_embedding():
    model = GPTModel(make_config(), seed=1)
    tokens = torch.randint(0, 128, (2, 16))
    logits = model(tokens)
    losses = model(tokens, tokens)
    expected = F.cross_entropy(logits.reshape(-1, 128), tokens.reshape(-1), reduction="none")
    torch.testing.assert_close(losses, expected.view(2, 16))
    assert model.output_weight() is model.embedding.word_embeddings.weight


def test_a_later_stages_tied_output_layer_is_named_and_starts_as_the_embedding():
    """PP 2: the last stage's output layer is a copy of the first stage's word embeddings,
    under their single-process name and with their initial values (the one-stage model's)."""
    whole = GPTModel(make_config(num_layers=2), seed=1)
    last = GPTModel(make_config(num_layers=2), seed=1,
                    stage=Stage(chunk=0, pp_rank=1, pp_size=2, num_chunks=1))
    names = {single_process_name(n, p): p for n, p in last.named_parameters()}
    assert "output_layer.weight" not in names
    torch.testing.assert_close(names["embedding.word_embeddings.weight"],
                               whole.embedding.word_embeddings.weight, rtol=0, atol=0)


def test_causality():
    """Changing a later token never changes an earlier position's logits."""
    model = GPTModel(make_config(position_embedding_type="rope", num_query_groups=2), seed=1)
    tokens = torch.randint(0, 128, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 128
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(tokens)[:, 10:], model(changed)[:, 10:])


def test_rope_table_stay_fp32_in_a_bf16_model():
    """Position p's angle is p x base^(-2i/d): in bf16 (8 significant bits) positions
    above 256 would share angles. The model keeps them in fp32 whatever its dtype."""
    config = tiny_gpt_config(num_layers=1, hidden_size=16, ffn_hidden_size=32,
                             num_attention_heads=2, seq_length=4096, padded_vocab_size=16,
                             position_embedding_type="rope", attention_dropout=0.1,
                             hidden_dropout=0.1)
    model = GPTModel(config, seed=0).to(torch.bfloat16)
    table = model.rope_table(torch.device("cpu"))
    angles = rotary_frequencies(4096, 8, config.rotary_base)
    assert table.dtype == angles.dtype == torch.float32
    assert torch.equal(table[:, 0], angles.cos()) and torch.equal(table[:, 1], angles.sin())
    assert angles[4001, 0] - angles[4000, 0] == 1.0  # distinct positions, distinct angles
    assert model.rope_table(torch.device("cpu")) is table  # computed once, read by every layer
