"""HF conversion against the HF models themselves: the same weights must give the same
logits in megalite and in transformers' own GPT-2 / Llama / Qwen3 code, in both directions."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402  (a dependency of transformers)

from megalite.errors import ConfigError  # noqa: E402
from megalite.hf_convert import (export_to_hf, hf_config_and_state_dict,  # noqa: E402
                                 import_from_hf, pad_vocab)
from megalite.config import GPTConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402

from tests.helpers import LLAMA_STYLE as LLAMA, tiny_gpt_config  # noqa: E402

VOCAB, PADDED = 101, 128
GPT2_STYLE = {}
LLAMA_STYLE = dict(LLAMA, num_query_groups=2, ffn_hidden_size=96, rotary_base=500000)
# Qwen3's head_dim (kv_channels) need not be hidden / heads.
QWEN3_STYLE = dict(LLAMA_STYLE, qk_layernorm=True, kv_channels=24, norm_epsilon=1e-6)


def make_config(**kw) -> GPTConfig:
    base = dict(hidden_size=64, ffn_hidden_size=256, kv_channels=16, seq_length=32,
                padded_vocab_size=PADDED, vocab_size=VOCAB, attention_backend="unfused",
                norm_epsilon=1e-5)
    return tiny_gpt_config(**{**base, **kw})


def random_model(config: GPTConfig) -> GPTModel:
    """Random values everywhere, norms and biases included (the init makes them 1 and 0,
    which would hide a swapped or transposed norm or bias)."""
    model = GPTModel(config, seed=1234).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "layernorm" in name:
                centre = 1.0 if name.endswith("weight") else 0.0
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=generator))
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                p[VOCAB:] = 0  # as initialised; pad_vocab restores zeros after a round trip
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))


def megalite_logits(model: GPTModel) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens())[..., :VOCAB]


def hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(tokens()).logits


def load_hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                             attn_implementation="eager")


@pytest.mark.parametrize("style, hf_class", [
    (GPT2_STYLE, "GPT2LMHeadModel"),
    (LLAMA_STYLE, "LlamaForCausalLM"),
    ({**LLAMA_STYLE, "untie_embeddings_and_output_weights": False, "num_query_groups": 1},
     "LlamaForCausalLM"),
    (QWEN3_STYLE, "Qwen3ForCausalLM"),
], ids=["gpt2", "llama-gqa-untied", "llama-mqa-tied", "qwen3"])
def test_export_matches_hf_logits(tmp_path, style, hf_class):
    config = make_config(**style)
    model = random_model(config)
    out = export_to_hf(config, model.state_dict(), tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging left behind
    hf_model = load_hf(out)
    assert type(hf_model).__name__ == hf_class
    tied = not config.untie_embeddings_and_output_weights
    assert hf_model.config.tie_word_embeddings == tied
    assert hf_model.config.vocab_size == VOCAB
    torch.testing.assert_close(hf_logits(hf_model), megalite_logits(model), atol=1e-5, rtol=0)


def test_export_dtype_and_overwrite(tmp_path):
    config = make_config()
    state = random_model(config).state_dict()
    out = export_to_hf(config, state, tmp_path / "hf", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="already exists"):
        export_to_hf(config, state, out)
    stored = load_file(out / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    export_to_hf(config, state, out, overwrite=True)
    assert load_hf(out).transformer.wte.weight.dtype == torch.float32


def tiny_hf_model(kind: str, **kw):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(**{**dict(
            vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
            activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None), **kw})
        model = transformers.GPT2LMHeadModel(config)
    else:
        qwen3 = kind == "qwen3"
        config = (transformers.Qwen3Config if qwen3 else transformers.LlamaConfig)(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
            **(dict(head_dim=24) if qwen3 else {}), **kw)
        model = (transformers.Qwen3ForCausalLM if qwen3 else transformers.LlamaForCausalLM)(
            config)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("kind, kw", [("gpt2", {}), ("llama", {}),
                                      ("llama", dict(tie_word_embeddings=True)), ("qwen3", {})],
                         ids=["gpt2", "llama-untied", "llama-tied", "qwen3"])
def test_import_matches_hf_logits(kind, kw):
    assert_imports_to_hf_logits(tiny_hf_model(kind, **kw))


def assert_imports_to_hf_logits(hf_model) -> None:
    """The imported weights in megalite give the HF model's logits."""
    fields, state = import_from_hf(hf_model)
    config = GPTConfig(**fields, padded_vocab_size=PADDED, attention_dropout=0.0,
                       hidden_dropout=0.0, attention_backend="sdpa")
    model = GPTModel(config, seed=1).eval()
    model.load_state_dict(pad_vocab(state, PADDED), strict=True)
    torch.testing.assert_close(megalite_logits(model), hf_logits(hf_model), atol=1e-5, rtol=0)


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE, QWEN3_STYLE],
                         ids=["gpt2", "llama", "qwen3"])
def test_round_trip_is_bitwise(tmp_path, style):
    config = make_config(**style)
    state = random_model(config).state_dict()
    fields, imported = import_from_hf(export_to_hf(config, state, tmp_path / "hf"))
    assert config == GPTConfig(**{**fields, "seq_length": config.seq_length},
                               padded_vocab_size=PADDED, attention_dropout=0.0,
                               hidden_dropout=0.0, attention_backend="unfused",
                               init_method_std=config.init_method_std)
    imported = pad_vocab(imported, PADDED)
    assert imported.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(imported[name], t), name


@pytest.mark.parametrize("kw, field", [
    (dict(normalization="RMSNorm"), "normalization"),
    (dict(swiglu=True), "swiglu"),
    ({**LLAMA_STYLE, "add_bias_linear": True}, "add_bias_linear"),
    ({**LLAMA_STYLE, "rotary_percent": 0.5}, "rotary_percent"),
    (dict(num_query_groups=2), "num_query_groups"),
    (dict(qk_layernorm=True), "qk_layernorm"),
])
def test_unsupported_config_is_refused(kw, field):
    config = make_config(**kw)
    with pytest.raises(ConfigError, match=field):
        hf_config_and_state_dict(config, GPTModel(config, seed=1).state_dict())


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE, QWEN3_STYLE],
                         ids=["gpt2", "llama", "qwen3"])
def test_token_ids_reach_the_config(style):
    """hf_config_kwargs override the config's defaults (hf_convert's docstring: the
    tokenizer's eos_token_id), in every style."""
    config = make_config(**style)
    hf_config, _ = hf_config_and_state_dict(config, GPTModel(config, seed=1).state_dict(),
                                            eos_token_id=7, bos_token_id=3)
    assert (hf_config.eos_token_id, hf_config.bos_token_id) == (7, 3)


def test_state_dict_must_match_config():
    config = make_config()
    state = GPTModel(make_config(num_layers=1), seed=1).state_dict()
    with pytest.raises(ConfigError, match="decoder.layers.1"):
        hf_config_and_state_dict(config, state)


@pytest.mark.parametrize("kind, kw, field", [
    ("gpt2", dict(activation_function="gelu_new"), "activation_function"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
])
def test_unsupported_hf_config_is_refused(kind, kw, field):
    with pytest.raises(ConfigError, match=field):
        import_from_hf(tiny_hf_model(kind, **kw))


def test_approximate_gelu_is_imported_only_when_allowed():
    hf_model = tiny_hf_model("gpt2", activation_function="gelu_new")
    with pytest.warns(UserWarning, match="tanh approximation"):
        fields, _ = import_from_hf(hf_model, allow_gelu_approximation=True)
    assert fields["normalization"] == "LayerNorm"


def test_pad_vocab_appends_zero_rows():
    state = {"embedding.word_embeddings.weight": torch.ones(3, 2), "x": torch.ones(1)}
    padded = pad_vocab(state, 5)
    assert torch.equal(padded["embedding.word_embeddings.weight"],
                       torch.cat([torch.ones(3, 2), torch.zeros(2, 2)]))
    assert padded["x"] is state["x"]
    with pytest.raises(ConfigError, match="rows"):
        pad_vocab(state, 2)
