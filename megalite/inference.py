"""Autoregressive generation from a GPTModel with a key/value cache.

The prompt runs through the model once (prefill, causal attention within it); each new
token then runs alone, its query attending to the cached keys and values of every earlier
position, so a step costs one position's worth of compute instead of the whole sequence.
The model's own forward does it (GPTModel.forward with a `kv_cache`), so generation
computes what training computes; this module keeps the cache and the sampling.

Multi-latent attention caches per token what its K and V are made from, not K and V: the
normalised KV latent (kv_lora_rank) and the rotated RoPE key part shared by all heads
(qk_pos_emb_head_dim), and rebuilds K and V from them each step (LatentKVCache; DeepSeek-V2
§2.1.4; docs/design.md §34).

Under tensor parallelism each rank runs its shard: the column- and row-parallel layers do
their own collectives, each rank caches only its query groups' K/V (the whole latent under
MLA, which every rank's heads read), the model gathers the
logits of the vocabulary shards, and the sampled token is broadcast from TP rank 0 so
every rank feeds the same token to the next step. Pipeline parallelism is not used here:
a checkpoint saved at any (TP, PP, DP) layout loads as one stage (`load_model_weights`).
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpointing.loading import SavedCheckpoint
from megalite.checkpointing.saving import model_fields
from megalite.checkpointing.model_fields import check_model_compatible
from megalite.checkpointing.storage import find_checkpoint_to_load, read_metadata
from megalite.errors import CheckpointError, ConfigError
from megalite.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.rotary import uses_rotary
from megalite.parallel_state import group_rank, group_size
from megalite.tensor_parallel.params import local_shard


# --- sampling ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits: temperature, then top-k, then top-p."""
    greedy: bool = False
    """Take the most likely token; the other fields are then ignored."""
    temperature: float = 1.0
    """Logits are divided by it: < 1 sharpens the distribution, > 1 flattens it."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely
    tokens whose probabilities sum to at least top_p (1.0: all)."""

    def __post_init__(self):
        if self.greedy:
            return
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be positive, got {self.temperature} "
                              "(use --greedy for the most likely token)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: no top-k), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1] (1: no nucleus), got {self.top_p}")


GREEDY = Sampling(greedy=True)


def sample(logits: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [batch, vocab] (-inf for tokens that may not be drawn) -> token ids [batch]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # A token stays if the more likely ones before it have not reached top_p yet: the
        # most likely token always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


# --- the cache and one step ---------------------------------------------------------------

class LayerKVCache:
    """One layer's keys and values [batch, max_length, this rank's K/V heads, head dim],
    of which `length` positions are filled. Multi-latent attention's (`values_shape` given):
    `keys` holds the normalised KV latents [batch, max_length, kv_lora_rank] and `values` the
    rotated k_pe [batch, max_length, 1, qk_pos_emb_head_dim]."""

    def __init__(self, shape: tuple[int, ...], like: torch.Tensor, values_shape=None):
        self.keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.values = torch.empty(values_shape or shape, dtype=like.dtype, device=like.device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [batch, s, K/V heads, dim] of the next s positions -> all positions' so far."""
        end = self.length + k.shape[1]
        if end > self.keys.shape[1]:
            raise ValueError(f"the KV cache holds {self.keys.shape[1]} positions, not {end}")
        self.keys[:, self.length:end], self.values[:, self.length:end] = k, v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]


class KVCache:
    """Every layer's cache (`layers[i]`: layer i's) for `batch` sequences of up to
    `max_length` positions; the first `length` (the next token's position) are filled."""

    def __init__(self, model: GPTModel, batch: int, max_length: int):
        c, like = model.config, model.output_weight()
        self.layers = [LayerKVCache((batch, max_length, c.kv_lora_rank), like,
                                    (batch, max_length, 1, c.qk_pos_emb_head_dim))
                       if c.multi_latent_attention
                       else LayerKVCache((batch, max_length, layer.self_attention.num_groups,
                                          c.kv_channels), like)
                       for layer in model.decoder.layers.values()]

    def tensors(self) -> list[torch.Tensor]:
        """What the cache holds, every layer's tensors (their bytes are its memory)."""
        return [t for layer in self.layers for t in (layer.keys, layer.values)]

    @property
    def length(self) -> int:
        return self.layers[0].length


@torch.no_grad()
def next_token_logits(model: GPTModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run tokens [batch, s] after the cached positions (their K/V appended to the cache)
    and return the fp32 logits [batch, vocab] of the token after the last one, over the
    tokenizer's vocabulary. The padding columns are dropped rather than left at -inf:
    their number depends on the TP size, and so would the sampler's random draws."""
    logits = model(tokens, kv_cache=cache)[:, -1].float()
    return logits[:, :model.config.vocab_size or logits.shape[-1]]


def max_positions(config: GPTConfig) -> int:
    """Positions the model has embeddings for: its rotary angles cover --seq-length,
    a learned table --max-position-embeddings."""
    return config.seq_length if uses_rotary(config) else config.max_position_embeddings


def check_length(prompt_length: int, max_new_tokens: int, config: GPTConfig):
    if prompt_length < 1:
        raise ConfigError("the prompt is empty: generation needs at least one token to start")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    limit = max_positions(config)
    if prompt_length + max_new_tokens > limit:
        flag = "--seq-length" if uses_rotary(config) else "--max-position-embeddings"
        raise ConfigError(f"the prompt ({prompt_length} tokens) + --max-new-tokens "
                          f"({max_new_tokens}) = {prompt_length + max_new_tokens} tokens exceeds "
                          f"the model's {limit} positions ({flag}); shorten the prompt or "
                          f"lower --max-new-tokens")


def _check_whole_model(model: GPTModel):
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model (pre_process and post_process), "
                         "not one pipeline stage")
    if model.training:
        raise ValueError("call model.eval() before generating: no dropout at inference")
    if model.config.sequence_parallel:
        raise ValueError("build the model for generation with sequence_parallel=False: "
                         "a one-token step cannot be split along the sequence")


def _broadcast_from_first_tp_rank(tokens: torch.Tensor, tp_group):
    """Every TP rank draws with the same seed and the same logits up to round-off; the
    broadcast makes the choice identical even where round-off differs."""
    if group_size(tp_group) > 1:
        dist.broadcast(tokens, src=dist.get_global_rank(tp_group, 0), group=tp_group)


@torch.no_grad()
def generate(model: GPTModel, prompt: torch.Tensor, max_new_tokens: int,
             sampling: Sampling = GREEDY, eod: int | None = None, seed: int = 0) -> torch.Tensor:
    """prompt [batch, s] token ids -> the new tokens [batch, n], n <= max_new_tokens.

    Stops after max_new_tokens, or once every sequence has produced `eod`; a sequence
    that has ended continues with `eod`. Every TP rank of the model must call this with
    the same arguments; all get the same tokens.
    """
    _check_whole_model(model)
    batch, prompt_length = prompt.shape
    check_length(prompt_length, max_new_tokens, model.config)
    device = model.embedding.word_embeddings.weight.device
    prompt = prompt.to(device)
    if max_new_tokens == 0:
        return prompt.new_empty(batch, 0)
    cache = KVCache(model, batch, prompt_length + max_new_tokens - 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = next_token_logits(model, prompt, cache)
    ended = torch.zeros(batch, dtype=torch.bool, device=device)
    new_tokens = []
    while True:
        token = sample(logits, sampling, generator)
        _broadcast_from_first_tp_rank(token, model.tp_group)
        if eod is not None:
            token = token.masked_fill(ended, eod)
            ended |= token == eod
        new_tokens.append(token)
        if len(new_tokens) == max_new_tokens or bool(ended.all()):
            return torch.stack(new_tokens, dim=1)
        logits = next_token_logits(model, token[:, None], cache)


# --- loading -------------------------------------------------------------------------------

@torch.no_grad()
def load_model_weights(load: str | Path, model: GPTModel) -> tuple[int, Path, dict]:
    """Load the newest checkpoint in `load` (the tracker's) into the whole model `model`,
    whatever layout it was saved at: each parameter is reassembled from the saved shards
    and cut for this TP rank. The model only: no optimizer or RNG state. Returns
    (iteration, directory, metadata)."""
    found = find_checkpoint_to_load(load)
    if found is None:
        raise CheckpointError(f"--load {load}: no checkpoint there")
    iteration, directory = found
    meta = read_metadata(directory)
    check_model_compatible(meta["model"], model_fields(model.config), checkpoint=directory)
    saved = SavedCheckpoint(directory, meta)
    tp_rank, tp_size = group_rank(model.tp_group), group_size(model.tp_group)
    # A whole model's parameter names are the single-process names the checkpoint uses
    # (no "<chunk>." prefix, and no copy of a tied embedding on a last stage).
    for name, param in model.named_parameters():
        param.copy_(local_shard(saved.param(name), param, name, tp_rank, tp_size))
    return iteration, directory, meta
