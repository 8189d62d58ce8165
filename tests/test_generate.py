"""KV-cached generation (megalite/inference.py) against full forward passes of GPTModel
over the growing sequence, and the samplers against their definitions."""

import dataclasses

import pytest
import torch

from megalite.errors import ConfigError
from megalite.inference import GREEDY, KVCache, Sampling, generate, sample
from megalite.model.gpt import GPTModel

from tests.helpers import LLAMA_STYLE, tiny_gpt_config

STYLES = {
    # Learned positions, LayerNorm, GeLU, biases, tied output; 61 of 64 vocabulary rows
    # are real, so the padding must never be drawn.
    "gpt2": dict(vocab_size=61),
    # RoPE, RMSNorm, SwiGLU, GQA (4 heads, 2 K/V groups), no biases, untied output, and
    # QK-norm (Qwen3): the cache holds keys normalised, then rotated.
    "llama": dict(LLAMA_STYLE, num_query_groups=2, ffn_hidden_size=96, qk_layernorm=True),
    # Multi-latent attention (DeepSeek-V3's: query latent, latent norms, YaRN past its
    # original length): the cache holds the latent and the rotated k_pe, K and V rebuilt.
    "mla": dict(LLAMA_STYLE, multi_latent_attention=True, position_embedding_type="none",
                qk_layernorm=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
                qk_pos_emb_head_dim=4, v_head_dim=6, kv_channels=12, rope_type="yarn",
                rotary_scaling_factor=4.0, mscale_all_dim=1.0,
                yarn_original_max_position_embeddings=8),
}
PROMPT = [[5, 17, 3, 42, 8, 8, 29]]
NEW_TOKENS = 12


def make_model(style: str, seed: int = 3) -> GPTModel:
    # Large weights (init std 0.2): sharp, far-from-tied logits.
    config = tiny_gpt_config(**{"ffn_hidden_size": 128, "seq_length": 24, "init_method_std": 0.2,
                                **STYLES[style]})
    return GPTModel(config, seed=seed).eval()


def full_forward_logits(model: GPTModel, tokens: list[int]) -> torch.Tensor:
    """The no-cache reference: the whole sequence through GPTModel, the last position."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


@pytest.fixture(scope="module", params=sorted(STYLES))
def any_model(request):
    """Every style: for the tests of what the cache computes."""
    return make_model(request.param)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    """For the tests of sampling and stopping, which do not depend on the attention."""
    return make_model(request.param)


def test_greedy_matches_argmax_of_full_forward(any_model):
    model = any_model
    generated = generate(model, torch.tensor(PROMPT), NEW_TOKENS, GREEDY)[0].tolist()
    sequence = list(PROMPT[0])
    for _ in range(NEW_TOKENS):
        sequence.append(int(full_forward_logits(model, sequence).argmax()))
    assert generated == sequence[len(PROMPT[0]):]
    assert len(set(generated)) > 2  # a model that repeats one token would prove little


@pytest.mark.parametrize("chunks", [[1] * 19, [3, 4, 1, 1, 6, 1, 1, 2]],
                         ids=["token_by_token", "chunked"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_cached_logits_equal_full_forward(any_model, backend, chunks):
    """fp32: each chunk run after the cached earlier ones gives, at its last position, the
    full (no-cache) forward's logits at that position; token by token, at every position.
    Chunks longer than one token but shorter than the keys need the lower-right mask."""
    model = GPTModel(dataclasses.replace(any_model.config, attention_backend=backend),
                     seed=3).eval()
    tokens = torch.randint(0, 61, (2, sum(chunks)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache, end = KVCache(model, batch=2, max_length=tokens.shape[1]), 0
        for n in chunks:
            logits = model(tokens[:, end:end + n], kv_cache=cache)
            end += n
            assert logits.shape == (2, 1, 64) and cache.length == end
            torch.testing.assert_close(logits[:, 0], full[:, end - 1], rtol=1e-5, atol=1e-5)


def test_mla_cache_holds_the_latent_not_keys_and_values():
    """Per layer and token kv_lora_rank + qk_pos_emb_head_dim numbers (12 + 4), where K and
    V would take heads x (qk_head_dim + r + v_head_dim) = 4 x 18."""
    model = make_model("mla")
    cache = KVCache(model, batch=2, max_length=10)
    assert [tuple(t.shape) for t in cache.tensors()] == [(2, 10, 12), (2, 10, 1, 4)] * 2
    generate(model, torch.tensor(PROMPT), 3, GREEDY)  # runs on that cache
    per_token = sum(t[0, 0].numel() for t in cache.tensors())
    assert per_token == (12 + 4) * 2  # (kv_lora_rank + qk_pos_emb_head_dim) x layers


def test_top_k_1_is_greedy(model):
    greedy = generate(model, torch.tensor(PROMPT), NEW_TOKENS, GREEDY)
    top1 = generate(model, torch.tensor(PROMPT), NEW_TOKENS, Sampling(top_k=1, temperature=2.0),
                    seed=7)
    assert torch.equal(greedy, top1)


def test_batch_equals_each_prompt_alone(model):
    prompts = torch.tensor([PROMPT[0], [1, 2, 3, 4, 5, 6, 7]])
    together = generate(model, prompts, NEW_TOKENS, GREEDY)
    for row, prompt in enumerate(prompts):
        assert torch.equal(together[row], generate(model, prompt[None], NEW_TOKENS, GREEDY)[0])


def top_k_set(logits: torch.Tensor, k: int) -> set[int]:
    return set(logits.argsort(descending=True)[:k].tolist())


def nucleus(logits: torch.Tensor, temperature: float, p: float) -> set[int]:
    """The smallest set of most likely tokens of softmax(logits / T) with mass >= p."""
    probs = (logits.double() / temperature).softmax(-1)
    kept, mass = set(), 0.0
    for token in probs.argsort(descending=True).tolist():
        kept.add(token)
        mass += float(probs[token])
        if mass >= p:
            return kept
    return kept


@pytest.mark.parametrize("sampling", [Sampling(top_k=5, temperature=1.5),
                                      Sampling(top_p=0.6, temperature=0.8),
                                      Sampling(top_p=0.9)])
def test_sampling_is_seeded_and_stays_in_its_set(model, sampling):
    prompt = torch.tensor(PROMPT)
    first = generate(model, prompt, NEW_TOKENS, sampling, seed=11)[0].tolist()
    assert first == generate(model, prompt, NEW_TOKENS, sampling, seed=11)[0].tolist()
    others = [generate(model, prompt, NEW_TOKENS, sampling, seed=s)[0].tolist()
              for s in range(3)]
    assert any(other != first for other in others)  # the seed matters
    sequence = list(PROMPT[0])
    for token in first:
        logits = full_forward_logits(model, sequence)
        allowed = (top_k_set(logits, sampling.top_k) if sampling.top_k
                   else nucleus(logits, sampling.temperature, sampling.top_p))
        assert token in allowed
        assert token < model.config.vocab_size if model.config.vocab_size else True
        sequence.append(token)


def test_sample_frequencies_follow_softmax_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).expand(20000, 5)
    draws = sample(logits, Sampling(temperature=2.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws.flatten(), minlength=5).double() / draws.numel()
    expected = (logits[0].double() / 2.0).softmax(-1)
    assert freq[4] == 0
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_p_keeps_the_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: p = 0.75 needs the first two, p = 0.85 three.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    generator = torch.Generator().manual_seed(0)
    for p, allowed in ((0.75, {0, 1}), (0.85, {0, 1, 2}), (0.4, {0})):
        drawn = set(sample(logits.expand(400, 4), Sampling(top_p=p), generator).tolist())
        assert drawn == allowed, (p, drawn)


def test_sampled_tokens_do_not_depend_on_vocabulary_padding():
    """TP sizes pad the vocabulary differently; the draws must not see the padding."""
    padded = [make_model("gpt2"),
              GPTModel(dataclasses.replace(make_model("gpt2").config, padded_vocab_size=128),
                       seed=3).eval()]
    sampling = Sampling(temperature=3.0, top_p=0.99)
    a, b = (generate(m, torch.tensor(PROMPT), NEW_TOKENS, sampling, seed=2) for m in padded)
    assert torch.equal(a, b)


def test_stops_at_end_of_document(model):
    greedy = generate(model, torch.tensor(PROMPT), NEW_TOKENS, GREEDY)[0].tolist()
    eod = greedy[3]
    stopped = generate(model, torch.tensor(PROMPT), NEW_TOKENS, GREEDY, eod=eod)[0].tolist()
    assert stopped == greedy[:greedy.index(eod) + 1]


def test_prompt_too_long_is_refused(model):
    limit = model.config.seq_length
    prompt = torch.zeros(1, limit - 3, dtype=torch.long)
    assert generate(model, prompt, 3, GREEDY).shape == (1, 3)
    with pytest.raises(ConfigError, match=r"exceeds the model's 24 positions.*--max-new-tokens"):
        generate(model, prompt, 4, GREEDY)
    with pytest.raises(ConfigError, match="the prompt is empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 4, GREEDY)


@pytest.mark.parametrize("kw, message", [(dict(temperature=0.0), "--temperature"),
                                         (dict(top_k=-1), "--top-k"),
                                         (dict(top_p=0.0), "--top-p"),
                                         (dict(top_p=1.5), "--top-p")])
def test_bad_sampling_flags_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        Sampling(**kw)


def test_model_in_training_mode_is_refused():
    """The forward of a model in training mode draws dropout masks: generation refuses it
    rather than sample from a perturbed model."""
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        generate(make_model("gpt2").train(), torch.tensor(PROMPT), 2, GREEDY)
