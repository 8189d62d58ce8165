"""HF conversion of mixtures of experts against transformers' own Mixtral, Qwen2-MoE and
Qwen3-MoE code: the same weights give the same logits in megalite and in HF, in both
directions, and a round trip is bit-exact (megalite/hf_moe.py)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megalite.config import GPTConfig  # noqa: E402
from megalite.errors import ConfigError  # noqa: E402
from megalite.hf_convert import (export_to_hf, hf_config_and_state_dict,  # noqa: E402
                                 import_from_hf, pad_vocab)
from megalite.model.gpt import GPTModel  # noqa: E402

from tests.test_hf_convert import (LLAMA_STYLE, PADDED, VOCAB,  # noqa: E402
                                   assert_imports_to_hf_logits, hf_logits, load_hf,
                                   make_config, megalite_logits, random_model)

MOE = dict(LLAMA_STYLE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
STYLES = {
    # Every layer MoE, top-k renormalised: Mixtral.
    "mixtral": (dict(MOE, moe_layer_pattern=(True, True)), "MixtralForCausalLM"),
    # A dense layer, a shared expert and pre-softmax routing: only Qwen2-MoE has them.
    "qwen2-moe": (dict(MOE, moe_layer_pattern=(False, True), moe_router_pre_softmax=True,
                       moe_shared_expert_intermediate_size=48, moe_router_topk=3),
                  "Qwen2MoeForCausalLM"),
    # Pre-softmax without a shared expert: a 0-wide HF shared expert.
    "qwen2-moe-unshared": (dict(MOE, moe_layer_pattern=(True, True),
                                moe_router_pre_softmax=True), "Qwen2MoeForCausalLM"),
    # QK-norm (head_dim free of hidden / heads), a dense layer, renormalised top k.
    "qwen3-moe": (dict(MOE, qk_layernorm=True, kv_channels=24, moe_layer_pattern=(False, True)),
                  "Qwen3MoeForCausalLM"),
}


def moe_model(kw) -> GPTModel:
    """random_model's MoE: the router weights too are larger than their init, so that the
    routing varies from token to token and a swapped expert or gate would show."""
    model = random_model(make_config(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(50)
    return model


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # a 0-wide expert
@pytest.mark.parametrize("style", list(STYLES))
def test_export_matches_hf_logits_and_imports_back_bitwise(tmp_path, style):
    kw, hf_class = STYLES[style]
    config = make_config(**kw)
    model = moe_model(kw)
    state = model.state_dict()
    out = export_to_hf(config, state, tmp_path / "hf")
    hf_model = load_hf(out)
    assert type(hf_model).__name__ == hf_class and hf_model.config.architectures == [hf_class]
    torch.testing.assert_close(hf_logits(hf_model), megalite_logits(model), atol=1e-5, rtol=0)
    fields, imported = import_from_hf(out)
    if style == "mixtral":  # no dense layer: Mixtral keeps no dense MLP width
        assert fields["ffn_hidden_size"] == config.moe_ffn_hidden_size
        fields["ffn_hidden_size"] = config.ffn_hidden_size
    assert GPTConfig(**{**fields, "seq_length": config.seq_length}, padded_vocab_size=PADDED,
                     attention_dropout=0.0, hidden_dropout=0.0, attention_backend="unfused",
                     init_method_std=config.init_method_std) == config
    imported = pad_vocab(imported, PADDED)
    assert imported.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(imported[name], t), name


def tiny_hf_moe(kind: str, **kw):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6,
                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4,
                                            **kw)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3_moe":  # head_dim free of hidden / heads; no shared expert
        config = transformers.Qwen3MoeConfig(**{**common, **dict(
            intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=24,
            mlp_only_layers=[0], norm_topk_prob=False), **kw})
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(**{**common, **dict(
            intermediate_size=96, moe_intermediate_size=32, num_experts=4,
            shared_expert_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False,
            qkv_bias=False), **kw})
        model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms away from their 1 init
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("shared_expert_gate.weight"):
                p.zero_()  # megalite's shared expert is ungated (hf_moe.py)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1)  # a router that varies its choice
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_import_matches_hf_logits(kind):
    assert_imports_to_hf_logits(tiny_hf_moe(kind))


@pytest.mark.parametrize("kw, field", [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function"),
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(qk_layernorm=True, moe_shared_expert_intermediate_size=48), "shared_expert"),
])
def test_unsupported_moe_config_is_refused(kw, field):
    config = make_config(**dict(STYLES["mixtral"][0], **kw))
    with pytest.raises(ConfigError, match=field):
        hf_config_and_state_dict(config, GPTModel(config, seed=1).state_dict())


@pytest.mark.parametrize("kind, kw, field", [
    ("qwen2_moe", dict(qkv_bias=True), "qkv_bias"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("qwen2_moe", "gate", "shared_expert_gate"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
])
def test_unsupported_hf_moe_is_refused(kind, kw, field):
    hf_model = tiny_hf_moe(kind, **(kw if isinstance(kw, dict) else {}))
    if kw == "gate":
        with torch.no_grad():
            hf_model.model.layers[1].mlp.shared_expert_gate.weight.fill_(0.5)
    with pytest.raises(ConfigError, match=field):
        import_from_hf(hf_model)
