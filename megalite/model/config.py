"""The model's shape, as one frozen dataclass handed to every module that builds weights."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """K/V heads; equal to num_attention_heads without grouped-query attention."""
    kv_channels: int
    """Per-head dimension."""
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int
    """Vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary; logits of the padding beyond it are masked out.
    None: no padding (vocab_size = padded_vocab_size)."""
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    attention_backend: str = "sdpa"
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    """None, "full" (transformer layers) or "selective" (core attention only)."""
    recompute_method: str | None = None
    """With "full": "uniform" (groups of recompute_num_layers layers) or "block" (the
    first recompute_num_layers layers of each model chunk)."""
    recompute_num_layers: int = 1
    compile_layers: bool = False
    """torch.compile each transformer layer (--compile-layers)."""
    cp_comm_type: str = "p2p"
    """How attention reaches the keys of other context-parallel ranks: "p2p" (ring) or
    "all_gather" (--cp-comm-type); unused at CP 1."""

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        return self.num_query_groups * self.kv_channels
