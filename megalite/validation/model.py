"""The model's flags -> GPTConfig's derived fields (Megatron's defaults for the MLP width, the
head size, the query groups, the position table and the padded vocabulary), each shape
checked against the tensor-parallel split; and the model flags no config keeps: the ones
GPTConfig's fields are derived from, and Megatron's kernel switches."""

from dataclasses import dataclass

from megalite.config import ParallelConfig
from megalite.config.flags import flag
from megalite.errors import ConfigError
from megalite.validation.checks import check_fraction, check_positive
from megalite.validation.fp8 import check_fp8
from megalite.validation.mla import mla_model_fields
from megalite.validation.moe import moe_model_fields
from megalite.validation.mtp import check_mtp


@dataclass(frozen=True)
class ModelFlags:
    GROUP = "model"

    group_query_attention: bool = flag(
        False, help="Use grouped-query attention (--num-query-groups K/V heads).")
    make_vocab_size_divisible_by: int = flag(
        128, help="Pad the vocabulary to a multiple of this (times TP size).")
    use_flash_attn: bool = flag(
        False, help="Alias of --attention-backend flash (flash-attn: head size <= 256 and a "
                    "multiple of 8).")


@dataclass(frozen=True)
class KernelSwitches:
    """Megatron's switches for its own fused kernels (Transformer Engine, Apex, its JIT
    fusions). megalite has none of these kernels to switch off: on a GPU its compiled layers
    fuse the same ops. Accepted, with no effect, so that a Megatron launch script runs as
    written."""
    GROUP = "kernels"
    NO_EFFECT = "Megatron's; no effect in megalite."

    no_masked_softmax_fusion: bool = flag(False, help=NO_EFFECT)
    no_bias_gelu_fusion: bool = flag(False, help=NO_EFFECT)
    no_bias_swiglu_fusion: bool = flag(False, help=NO_EFFECT)
    no_bias_dropout_fusion: bool = flag(False, help=NO_EFFECT)
    no_rope_fusion: bool = flag(False, help=NO_EFFECT)
    no_persist_layer_norm: bool = flag(False, help=NO_EFFECT)
    no_gradient_accumulation_fusion: bool = flag(False, help=NO_EFFECT)
    attention_softmax_in_fp32: bool = flag(False, help=NO_EFFECT)
    use_mcore_models: bool = flag(False, help=NO_EFFECT)
    transformer_impl: str = flag(
        "transformer_engine", choices=["local", "transformer_engine"],
        help="Megatron's; megalite runs its own layers under either name (compiled on a GPU by "
             "default, where Megatron would use Transformer Engine).")
    cross_entropy_fusion_impl: str = flag(
        "native", choices=["native"],
        help="Megatron's; its Transformer Engine kernel (te) is not available.")


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by x TP so every TP shard
    of the embedding and output layer has the same number of rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def model_fields(args, parallel: ParallelConfig, tokenizer_vocab_size: int | None) -> dict:
    """GPTConfig's derived fields, after the checks of every model flag."""
    heads, hidden, tp = (args.num_attention_heads, args.hidden_size,
                         parallel.tensor_model_parallel_size)
    vocab_size = _vocab_size(args, tokenizer_vocab_size)
    mla = mla_model_fields(args, parallel)
    kv_channels = args.kv_channels
    if args.multi_latent_attention:  # its query/key head; MLA refuses --kv-channels
        kv_channels = args.qk_head_dim + args.qk_pos_emb_head_dim
    elif kv_channels is None:
        if hidden % heads:
            raise ConfigError(f"--hidden-size={hidden} is not divisible by "
                              f"--num-attention-heads={heads} (or set --kv-channels)")
        kv_channels = hidden // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    if groups <= 0 or heads % groups:
        raise ConfigError(f"--num-attention-heads={heads} is not divisible by "
                          f"--num-query-groups={groups}")
    _check_tensor_parallel_split(args, heads, groups, tp)
    _check_positions(args, kv_channels)
    check_fp8(args, parallel)
    check_mtp(args)
    check_fraction(args, "attention_dropout", "hidden_dropout")
    check_positive(args, "init_method_std")
    ffn = _ffn_size(args, tp)
    return dict(
        ffn_hidden_size=ffn, num_query_groups=groups, kv_channels=kv_channels,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        padded_vocab_size=pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp),
        vocab_size=vocab_size, attention_backend=_attention_backend(args, kv_channels),
        # At TP 1 sequence parallelism is the identity; Megatron turns it off likewise.
        sequence_parallel=args.sequence_parallel and tp > 1,
        recompute_num_layers=_recompute_num_layers(args),
        **moe_model_fields(args, parallel, ffn), **mla)


def _ffn_size(args, tp: int) -> int:
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    # Megatron's rule: SwiGLU has two input projections, so shrink to keep the
    # parameter count of a 4h GeLU MLP, rounded down to a multiple of 64.
    ffn = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if ffn % tp:
        raise ConfigError(f"the default MLP width {ffn} is not divisible by "
                          f"--tensor-model-parallel-size={tp}: set --ffn-hidden-size")
    return ffn


def _check_positions(args, kv_channels: int):
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > max_pos:
        raise ConfigError(f"--seq-length={args.seq_length} exceeds "
                          f"--max-position-embeddings={max_pos}")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.position_embedding_type == "rope" and int(kv_channels * args.rotary_percent) % 2:
        raise ConfigError(f"RoPE rotates channel pairs: --kv-channels={kv_channels} x "
                          f"--rotary-percent={args.rotary_percent} must be even")


def _recompute_num_layers(args) -> int:
    """Megatron's rules: full recompute names its method; selective takes none."""
    granularity, method, n = (args.recompute_granularity, args.recompute_method,
                              args.recompute_num_layers)
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method "
                          "(uniform or block)")
    if granularity == "selective" and args.compile_layers:
        # Its checkpoint sits inside the layer's forward, with a context_fn that swaps the
        # model-parallel RNG states: torch.compile cannot trace that (torch 2.13).
        raise ConfigError("--recompute-granularity selective recomputes inside each layer, "
                          "which --compile-layers cannot trace; inductor already recomputes "
                          "what is cheap in a compiled layer: drop one of the two, or use "
                          "--recompute-granularity full")
    if granularity != "full" and (method is not None or n is not None):
        raise ConfigError(f"--recompute-method/--recompute-num-layers apply to "
                          f"--recompute-granularity full only (got --recompute-granularity="
                          f"{granularity})")
    check_positive(args, "recompute_num_layers")
    return n or 1


def _check_tensor_parallel_split(args, heads: int, groups: int, tp: int):
    """Attention splits whole query groups (and heads) across TP ranks; the MLP splits
    its hidden units; sequence parallelism splits the sequence."""
    if heads % tp or groups % tp:
        raise ConfigError(f"--tensor-model-parallel-size={tp} must divide "
                          f"--num-attention-heads={heads} and the query groups ({groups}, "
                          "--num-query-groups under --group-query-attention)")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size={args.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size={tp}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"--sequence-parallel splits the sequence across TP ranks: "
                          f"--seq-length={args.seq_length} is not divisible by "
                          f"--tensor-model-parallel-size={tp}")


def _attention_backend(args, kv_channels: int) -> str:
    backend = args.attention_backend
    if args.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn conflicts with --attention-backend {backend}")
        backend = "flash"
    _check_document_backend(args, backend)
    if backend == "flash" and (kv_channels > 256 or kv_channels % 8):
        # flash-attn's kernels exist for head sizes up to 256 in steps of 8.
        raise ConfigError(f"--attention-backend flash (flash-attn) needs a head size "
                          f"(--kv-channels, default --hidden-size / --num-attention-heads) "
                          f"<= 256 and a multiple of 8, got {kv_channels}")
    return backend


def _check_document_backend(args, backend: str):
    """The attention kernels that cannot honour a document mask, or FlexAttention's limits."""
    masks = args.reset_attention_mask or args.dataloader_inter_document_masking
    flag = "--reset-attention-mask" if args.reset_attention_mask else \
        "--dataloader-inter-document-masking"
    if masks and backend == "flash" and args.context_parallel_size > 1 and \
            args.cp_comm_type == "p2p":
        raise ConfigError(f"{flag} with --cp-comm-type p2p runs the ring's blocks on "
                          "megalite's masked block kernel, which flash-attn is not: use "
                          "--attention-backend sdpa (or auto), or --cp-comm-type all_gather")
    if backend == "flex" and args.attention_dropout > 0:
        raise ConfigError(f"--attention-backend flex (FlexAttention) has no attention dropout: "
                          f"set --attention-dropout 0 (got {args.attention_dropout})")


def _vocab_size(args, tokenizer_vocab_size: int | None) -> int:
    if tokenizer_vocab_size is not None:
        return tokenizer_vocab_size
    if args.vocab_size is None or args.vocab_size < 3:
        raise ConfigError(f"the vocabulary comes from --tokenizer-type (and its files) or "
                          f"--vocab-size >= 3 (--mock-data), got --vocab-size={args.vocab_size}")
    return args.vocab_size
