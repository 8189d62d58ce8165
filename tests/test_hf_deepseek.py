"""DeepSeek-V3 HF conversion (megalite/hf_deepseek.py) against transformers' own
DeepseekV3ForCausalLM: the same weights give the same logits (fp32, 1e-5) after export
(transformers loads the folder) and after import (a transformers model, saved, imported),
with multi-latent attention with and without a query latent, YaRN, HF's rotate-half RoPE
layout (rope_interleave=False) as well as DeepSeek's interleaved one, a dense first layer and
MoE layers with a shared expert, sigmoid routing with a nonzero expert bias, group-limited
routing and the routed scaling factor."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402  (transformers' dependency)

from megalite.config import GPTConfig  # noqa: E402
from megalite.errors import ConfigError  # noqa: E402
from megalite.hf_convert import export_to_hf, import_from_hf, pad_vocab  # noqa: E402
from megalite.inference import GREEDY, generate  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402

from tests.test_hf_convert import (LLAMA_STYLE, PADDED, VOCAB,  # noqa: E402
                                   assert_imports_to_hf_logits, hf_logits, load_hf,
                                   make_config, megalite_logits, random_model, tokens)

MLA = dict(LLAMA_STYLE, multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16,
           qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, kv_channels=24,
           num_query_groups=4, norm_epsilon=1e-6)  # HF's latent norms' eps (hf_deepseek.py)
DEEPSEEK_MOE = dict(num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=32,
                    moe_layer_pattern=(False, True), moe_shared_expert_intermediate_size=64,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
STYLES = {
    # DeepSeek-V3's shape in small: query latent, YaRN past its original length, 8 experts
    # in 4 groups (2 chosen, top 4), scaled gate values, two shared experts' width.
    "q-lora-yarn-groups": dict(MLA, **DEEPSEEK_MOE, q_lora_rank=24, rope_type="yarn",
                               rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=1.0,
                               yarn_original_max_position_embeddings=8,
                               moe_router_num_groups=4, moe_router_group_topk=2,
                               moe_router_topk_scaling_factor=2.5),
    # No query latent (DeepSeek-V2-Lite's), plain RoPE, no groups, tied embeddings.
    "no-q-lora-rope": dict(MLA, **{**DEEPSEEK_MOE, "moe_router_topk": 2}, rope_type="rope",
                           untie_embeddings_and_output_weights=False),
}


def deepseek_model(kw) -> GPTModel:
    """random_model with a router that varies its choice and a nonzero expert bias that
    changes some of it."""
    model = random_model(make_config(**kw))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(50)
            if name.startswith("mtp.") and p.dim() == 1:  # enorm, hnorm: not 1 either
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.linspace(-0.2, 0.3, b.numel()))
    return model


@pytest.mark.parametrize("style", list(STYLES))
def test_export_matches_hf_logits_and_imports_back_bitwise(tmp_path, style):
    config = make_config(**STYLES[style])
    model = deepseek_model(STYLES[style])
    state = model.state_dict()
    out = export_to_hf(config, state, tmp_path / "hf")
    hf_model = load_hf(out)
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    assert hf_model.config.architectures == ["DeepseekV3ForCausalLM"]
    torch.testing.assert_close(hf_logits(hf_model), megalite_logits(model), atol=1e-5, rtol=0)
    fields, imported = import_from_hf(out)
    assert GPTConfig(**{**fields, "seq_length": config.seq_length}, padded_vocab_size=PADDED,
                     attention_dropout=0.0, hidden_dropout=0.0, attention_backend="unfused",
                     ) == config
    imported = pad_vocab(imported, PADDED)
    assert imported.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(imported[name], t), name


def test_bf16_export_keeps_the_expert_bias_fp32(tmp_path):
    """--dtype bf16 rounds the weights, not the fp32 bias (it would move the choice)."""
    kw = STYLES["no-q-lora-rope"]
    out = export_to_hf(make_config(**kw), deepseek_model(kw).state_dict(), tmp_path / "hf",
                       dtype=torch.bfloat16)
    dtypes = {name: t.dtype for name, t in load_file(out / "model.safetensors").items()}
    assert dtypes.pop("model.layers.1.mlp.gate.e_score_correction_bias") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}


def tiny_hf_deepseek(**kw):
    """transformers' own DeepseekV3ForCausalLM, random, norms away from 1, a nonzero
    e_score_correction_bias, one dense layer then a MoE layer with a shared expert."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=4, n_group=2, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=32,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, num_mtp_layers=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                             mscale_all_dim=1.0, original_max_position_embeddings=8)), **kw})
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.3, 8))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("kw", [
    {}, dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False)],
    ids=["q-lora-yarn-groups", "no-q-lora-rotate-half"])
def test_import_of_saved_hf_model_matches_its_logits(tmp_path, kw):
    hf_model = tiny_hf_deepseek(**kw)
    hf_model.save_pretrained(tmp_path / "hf")
    fields, state = import_from_hf(tmp_path / "hf")
    config = GPTConfig(**fields, padded_vocab_size=PADDED, attention_dropout=0.0,
                       hidden_dropout=0.0, attention_backend="sdpa")
    model = GPTModel(config, seed=1).eval()
    model.load_state_dict(pad_vocab(state, PADDED), strict=True)
    torch.testing.assert_close(megalite_logits(model), hf_logits(hf_model), atol=1e-5, rtol=0)
    assert_imports_to_hf_logits(hf_model)  # the loaded model itself, not its folder
    # Greedy generation on megalite's latent KV cache picks transformers' tokens (its own
    # generate, on its own cache of the latent).
    prompt = tokens()[:1, :10]
    theirs = hf_model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert generate(model, prompt, 8, GREEDY)[0].tolist() == theirs[0, 10:].tolist()


@pytest.mark.parametrize("kw, field", [
    (dict(qk_layernorm=False), "qk_layernorm"),
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
     "moe_router_score_function"),
    (dict(moe_layer_pattern=(True, False)), "moe_layer_pattern"),
    (dict(moe_shared_expert_intermediate_size=48), "n_shared_experts"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "top 2"),
    (dict(num_experts=None, moe_layer_pattern=None, moe_ffn_hidden_size=None,
          moe_shared_expert_intermediate_size=None, mtp_num_layers=1), "MTP layers are MoE"),
])
def test_unsupported_model_is_refused_on_export(tmp_path, kw, field):
    config = make_config(**{**STYLES["no-q-lora-rope"], **kw})
    with pytest.raises(ConfigError, match=field):
        export_to_hf(config, GPTModel(config, seed=1).state_dict(), tmp_path / "hf")


@pytest.mark.parametrize("kw, field", [
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)), "linear"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=4, topk_group=1), "topk_group"),
])
def test_unsupported_hf_model_is_refused_on_import(kw, field):
    with pytest.raises(ConfigError, match=field):
        import_from_hf(tiny_hf_deepseek(**kw))


def test_latent_norm_eps_gap_is_warned_both_ways(tmp_path):
    """transformers' latent norms take eps 1e-6 whatever rms_norm_eps says: an export at
    another --norm-epsilon, and an import of such a config, say so."""
    kw = {**STYLES["no-q-lora-rope"], "norm_epsilon": 1e-5}
    config = make_config(**kw)
    with pytest.warns(UserWarning, match="q_a_layernorm, kv_a_layernorm"):
        out = export_to_hf(config, deepseek_model(kw).state_dict(), tmp_path / "hf")
    with pytest.warns(UserWarning, match="rms_norm_eps=1e-05"):
        import_from_hf(out)


# DeepSeek-V3's checkpoint layout of its MTP module (layer 61 there, num_layers here): its own
# tensors, copies of the embedding and output layer, and a MoE transformer layer's tensors.
DEEPSEEK_MTP_NAMES = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                      "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                      "post_attention_layernorm.weight", "self_attn.q_a_proj.weight",
                      "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
                      "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                      "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight",
                      "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
                      "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
                      *(f"mlp.experts.{e}.{p}.weight" for e in range(8)
                        for p in ("gate_proj", "up_proj", "down_proj"))}


def test_mtp_weights_as_deepseek_keeps_them(tmp_path, monkeypatch):
    """--mtp-num-layers 1 exports as DeepSeek's checkpoints hold it (layer num_layers), which
    transformers' own MtpModel loads and computes megalite's depth-1 logits with; the import
    reads it back bitwise, and refuses copies of the output layer that differ."""
    kw = {**STYLES["q-lora-yarn-groups"], "mtp_num_layers": 1}
    config, model = make_config(**kw), deepseek_model(kw)
    out = export_to_hf(config, model.state_dict(), tmp_path / "hf")
    files = load_file(out / "model.safetensors")
    assert {n[len("model.layers.2."):] for n in files if n.startswith("model.layers.2.")} \
        == DEEPSEEK_MTP_NAMES
    # transformers finds MTP layers by DeepSeek-V3's layer number (61): point it at 2.
    monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                        [r"model\.layers\.2.*"])
    hf_model = load_hf(out)
    hf_mtp = transformers.modeling_layers.MtpModel.from_pretrained(hf_model)
    inputs, labels = tokens()[:, :-1], tokens()[:, 1:]
    with torch.no_grad():
        x = model.embedding(inputs)
        table = model.rope_table(x.device)
        depth1 = model.mtp.layers[0](model.decoder(x, table), model.embedding(labels), table)
        ours = model._vocab_parallel_logits(depth1).transpose(0, 1)[..., :VOCAB]
        last = hf_model(inputs, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)
        theirs = hf_mtp._project_to_logits(hf_mtp.forward_layer(0, last, positions, None,
                                                                input_ids=labels))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    fields, imported = import_from_hf(out)
    assert fields["mtp_num_layers"] == 1
    state = model.state_dict()
    imported = pad_vocab(imported, PADDED)
    assert imported.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(imported[name], t), name
    files["model.layers.2.shared_head.head.weight"] = files["lm_head.weight"] * 2
    save_file(files, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="shared_head.head.weight differs from lm_head"):
        import_from_hf(out)
