"""GPTConfig: the model (megalite/model/), its shape and the choices that change what it
computes; each field with the flag it comes from (config/flags.py). Every fact of the model's
shape (sequence length, vocabulary, sequence parallelism) lives here and nowhere else."""

from dataclasses import dataclass

from megalite.config.flags import flag


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    GROUP = "model"

    num_layers: int = flag(help="Number of transformer layers.")
    hidden_size: int = flag(help="Transformer hidden size.")
    # Derived: 4h, or with --swiglu 8h/3 rounded down to a multiple of 64.
    ffn_hidden_size: int = flag(help="MLP hidden size (default 4 x hidden size).")
    num_attention_heads: int = flag(help="Number of attention heads.")
    # Equal to num_attention_heads without --group-query-attention.
    num_query_groups: int = flag(unset=1, help="Number of K/V head groups under "
                                               "--group-query-attention.")
    kv_channels: int = flag(help="Per-head dimension (default hidden size / heads).")
    seq_length: int = flag(help="Sequence length to train on.")
    max_position_embeddings: int = flag(
        help="Size of the learned position table (default --seq-length).")
    padded_vocab_size: int
    """Vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary; logits of the padding beyond it are masked out.
    None: no padding (vocab_size = padded_vocab_size)."""
    position_embedding_type: str = flag(
        "learned_absolute", choices=["learned_absolute", "rope", "none"],
        help="Position embedding. With --multi-latent-attention rope or none: its attention "
             "rotates its own RoPE part (--rope-type), as in Megatron.")
    rotary_base: int = flag(10000, help="RoPE base.")
    rotary_percent: float = flag(1.0, help="Fraction of each head's channels rotated by RoPE.")
    normalization: str = flag("LayerNorm", choices=["LayerNorm", "RMSNorm"],
                              help="The norm layers.")
    norm_epsilon: float = flag(1e-5, help="Added to the variance in each normalization.")
    swiglu: bool = flag(False, help="SwiGLU MLP instead of GeLU.")
    qk_layernorm: bool = flag(
        False, help="Normalize each head's query and key (--normalization, one weight of "
                    "kv_channels shared by all heads) before RoPE (Qwen3, OLMo 2); with "
                    "--multi-latent-attention the query and key/value latents instead "
                    "(q_layernorm, kv_layernorm), as Megatron does.")
    # Multi-latent attention (DeepSeek-V2 §2.1; docs/design.md §32). Megatron's flags,
    # defaults and meanings (its _add_mla_args and MLATransformerConfig).
    multi_latent_attention: bool = flag(
        False, help="Multi-latent attention: queries and keys/values through low-rank latents, "
                    "with a decoupled RoPE part per head (needs --position-embedding-type rope "
                    "or none).")
    q_lora_rank: int | None = flag(
        None, help="Rank of the query latent (unset: queries through one linear_q_proj, no "
                   "compression).")
    kv_lora_rank: int = flag(32, help="Rank of the key/value latent.")
    qk_head_dim: int = flag(128, help="Per-head query/key dimension without RoPE (the head is "
                                      "this plus --qk-pos-emb-head-dim).")
    qk_pos_emb_head_dim: int = flag(64, help="Per-head query/key dimension rotated by RoPE "
                                             "(one key part shared by all heads).")
    v_head_dim: int = flag(128, help="Per-head value dimension.")
    # Unset: yarn with --multi-latent-attention, rope without (validation/mla.py).
    rope_type: str = flag("rope", unset=None, choices=["rope", "yarn"],
                          help="RoPE of multi-latent attention: plain, or YaRN (Peng et al. "
                               "2023) as DeepSeek-V3 uses it (the default with "
                               "--multi-latent-attention, Megatron's); other attention takes "
                               "rope only.")
    rotary_scaling_factor: float = flag(1.0, help="YaRN's context extension factor.")
    mscale: float = flag(1.0, help="YaRN's mscale (numerator of the cos/sin factor).")
    mscale_all_dim: float = flag(0.0, help="YaRN's mscale_all_dim (denominator of the cos/sin "
                                           "factor; squared in the softmax scale).")
    # Megatron reads these three for its non-MLA YaRN and gives MLA its config's defaults
    # (4096, 32, 1) with no flag; megalite applies the flags to MLA as well.
    yarn_original_max_position_embeddings: int = flag(
        4096, help="YaRN's original context length (Megatron's flag, which there feeds "
                   "--position-embedding-type yarn only; megalite's --multi-latent-attention "
                   "reads it too).")
    yarn_beta_fast: float = flag(32.0, help="YaRN's beta_fast (Megatron's flag; read by "
                                            "--multi-latent-attention as above).")
    yarn_beta_slow: float = flag(1.0, help="YaRN's beta_slow (Megatron's flag; read by "
                                           "--multi-latent-attention as above).")
    add_bias_linear: bool = flag(True, "--disable-bias-linear",
                                 help="No biases in linear layers.")
    untie_embeddings_and_output_weights: bool = flag(
        False, help="Separate input embedding and output layer weights.")
    mtp_num_layers: int | None = flag(
        None, help="Multi-token prediction (DeepSeek-V3 §2.2): this many sequential MTP modules "
                   "after the model, module k predicting the token k + 1 ahead from the previous "
                   "depth's hidden state and the embedding of the token k ahead; on the last "
                   "pipeline stage, sharing the embedding and output layer (unset: none).")
    mtp_loss_scaling_factor: float = flag(
        0.1, help="Weight of the MTP losses: their mean over the depths times this is added "
                  "to the gradient (not to the reported lm loss; each depth is logged as "
                  "'mtp_k loss').")
    attention_dropout: float = flag(0.1, help="Dropout probability on the attention weights.")
    hidden_dropout: float = flag(0.1, help="Dropout probability on the embedding and each "
                                           "residual branch.")
    init_method_std: float = flag(
        0.02, help="Std of the normal init; output projections get std/sqrt(2L).")
    # A model built without flags runs sdpa; --use-flash-attn is "flash".
    attention_backend: str = flag(
        "sdpa", unset="auto", choices=["auto", "flash", "flex", "sdpa", "unfused"],
        help="Attention kernel: flash-attn, torch SDPA, FlexAttention (CUDA only; megalite's "
             "own choice, for document masks), or the explicit reference; auto picks "
             "the fastest available. Under --cp-comm-type p2p the ring's blocks run on torch's "
             "fused flash kernels for sdpa and flash (CPU; CUDA fp16/bf16), on megalite's fp32 "
             "block kernel for unfused, with attention dropout, and where torch has no fused "
             "kernel (sdpa; flash then stops with an error).")
    reset_position_ids: bool = flag(
        False, group="data", help="Positions (RoPE or learned) restart at 0 after each "
                                  "end-of-document token.")
    reset_attention_mask: bool = flag(
        False, group="data",
        help="Block-causal attention: a token sees the earlier tokens of its own document only "
             "(a document ends with the end-of-document token). The kernel takes the documents' "
             "boundaries (flash: varlen; sdpa: padded batches of documents; flex: a block mask); "
             "only --attention-backend unfused builds an [s, s] mask.")
    dataloader_inter_document_masking: bool = flag(
        False, group="data",
        help="The data loader hands each sample's document boundaries from the dataset's "
             "document index (no end-of-document token needed); attention is block-causal on "
             "them and positions restart, as with the two --reset flags.")
    # Off at TP 1, where it is the identity.
    sequence_parallel: bool = flag(
        False, group="parallelism",
        help="Activations outside the tensor-parallel regions split over the sequence across TP "
             "ranks.")
    recompute_granularity: str | None = flag(
        None, choices=["full", "selective"],
        help="Activation recompute: whole transformer layers (full) or only the core attention "
             "(selective).")
    recompute_method: str | None = flag(
        None, choices=["uniform", "block"],
        help="full: checkpoint groups of --recompute-num-layers layers (uniform), or the first "
             "--recompute-num-layers layers of each stage (block).")
    recompute_num_layers: int = flag(1, unset=None, help="Layers per recompute group or block "
                                                         "(default 1).")
    # None: neither flag given; training.build_model and the memory planner decide for their
    # device (Config.layers_compiled), a model built elsewhere runs eagerly.
    compile_layers: bool | None = flag(
        False, unset=None,
        help="torch.compile each transformer layer (megalite's own flag; Megatron has none, and "
             "fuses through Transformer Engine instead). Default: on when training on a GPU at "
             "TP 1 and CP 1 without --num-experts, --use-torch-fsdp2, --pipeline-schedule zb-h1 "
             "or --recompute-granularity selective, off otherwise; --no-compile-layers runs "
             "eagerly. Same results within bf16 round-off; the first step compiles, which takes "
             "a while.")
    cross_entropy_loss_fusion: bool = flag(
        False, group="kernels", help="Compile the loss (torch.compile) even with eager layers, at "
                                     "TP 1; with compiled layers it is compiled anyway. Over a TP "
                                     "group the loss is the eager vocab-parallel one. (Megatron's "
                                     "flag; its own kernel.)")
    cp_comm_type: str = flag(
        "p2p", group="parallelism", choices=["p2p", "all_gather"],
        help="How attention sees the other CP ranks' keys and values: p2p (ring attention, "
             "overlapped with compute; its blocks on the --attention-backend's kernel, see "
             "there) or all_gather (all K/V gathered; cheap with GQA). Megatron's a2a is not "
             "implemented.")
    fp8_format: str | None = flag(
        None, group="fp8", choices=["e4m3", "hybrid"],
        help="Run the transformer layers' linear GEMMs (QKV, projection, MLP) in FP8 with "
             "torch._scaled_mm: e4m3 for inputs and weights, gradients e4m3 too (e4m3) or e5m2 "
             "(hybrid). Master weights, optimizer state, checkpoints, norms, attention, the "
             "embedding and the output layer stay in the model's dtype. Needs compute "
             "capability >= 8.9 on a GPU; runs on CPUs.")
    # delayed, mxfp8 and blockwise are parsed to be refused by name (validation/fp8.py).
    fp8_recipe: str = flag(
        "tensorwise", group="fp8",
        choices=["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"],
        help="FP8 scaling: tensorwise (Megatron's name; one scale per tensor from its current "
             "amax, reduced over the TP group where it is sharded; megalite's default, "
             "Megatron's is delayed) or rowwise (megalite's own name for torchao's rowwise "
             "scaling: one scale per row along each GEMM's contraction dim; e4m3 only). "
             "delayed, mxfp8 and blockwise are Megatron's and not built.")
    first_last_layers_bf16: bool = flag(
        False, group="fp8", help="With --fp8-format: keep the first --num-layers-at-start-in-bf16 "
                                 "and the last --num-layers-at-end-in-bf16 transformer layers out "
                                 "of FP8.")
    num_layers_at_start_in_bf16: int = flag(
        1, group="fp8", help="Layers kept out of FP8 at the start (--first-last-layers-bf16).")
    num_layers_at_end_in_bf16: int = flag(
        1, group="fp8", help="Layers kept out of FP8 at the end (--first-last-layers-bf16).")
    num_experts: int | None = flag(
        None, group="moe", help="Routed experts per MoE layer (unset: a dense model).")
    moe_ffn_hidden_size: int | None = flag(
        None, group="moe", help="Hidden size of each routed expert (default --ffn-hidden-size).")
    moe_router_topk: int = flag(2, group="moe", help="Experts each token is routed to.")
    moe_layer_pattern: tuple[bool, ...] | None = None
    """Per global layer: whether its MLP is a MoE layer (derived once from --moe-layer-freq);
    None without experts."""
    moe_shared_expert_intermediate_size: int | None = flag(
        None, group="moe",
        help="Hidden size of the shared experts every token goes through (all shared experts as "
             "one dense MLP); unset: none.")
    # sinkhorn is parsed to be refused by name (validation/moe.py).
    moe_router_load_balancing_type: str = flag(
        "aux_loss", group="moe", choices=["aux_loss", "seq_aux_loss", "none", "sinkhorn"],
        help="aux_loss: Switch Transformer's over each micro-batch; seq_aux_loss: DeepSeek's per "
             "sequence; none. sinkhorn is Megatron's and not built.")
    moe_aux_loss_coeff: float = flag(
        0.0, group="moe", help="Weight of the load-balancing loss (added to the gradient, not "
                               "to the reported lm loss).")
    moe_z_loss_coeff: float | None = flag(
        None, group="moe", help="Weight of the router z-loss (ST-MoE); unset: none.")
    # DeepSeek-V3 §2.1.2: the bias is added to the scores for the choice of experts only.
    moe_router_enable_expert_bias: bool = flag(
        False, group="moe", help="Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias "
                                 "in the choice of experts, updated after each step from the "
                                 "tokens per expert of the global batch. Needs "
                                 "--moe-router-score-function sigmoid.")
    moe_router_bias_update_rate: float = flag(
        1e-3, group="moe", help="Step of the expert-bias update.")
    moe_router_score_function: str = flag(
        "softmax", group="moe", choices=["softmax", "sigmoid"],
        help="softmax, or sigmoid normalised over the chosen top k.")
    moe_router_topk_scaling_factor: float | None = flag(
        None, group="moe", help="Multiply the chosen experts' gate values by this (DeepSeek-V3's "
                                "routed_scaling_factor, 2.5); unset: 1.")
    # DeepSeek-V3 §2.1.2's node-limited routing, as Megatron builds it (router.py).
    moe_router_num_groups: int | None = flag(
        None, group="moe", help="Group-limited routing: the experts in this many equal groups "
                                "(consecutive expert ids); each token picks "
                                "--moe-router-group-topk groups, then its top k experts in them.")
    moe_router_group_topk: int | None = flag(
        None, group="moe", help="Groups each token may route to (with --moe-router-num-groups); "
                                "a group's score is the sum of its top (topk / this) expert "
                                "scores.")
    moe_router_pre_softmax: bool = flag(
        False, group="moe", help="Softmax over all experts before the top k (default: the top k "
                                 "logits, then a softmax among them).")
    moe_expert_capacity_factor: float | None = flag(
        None, group="moe",
        help="Capacity of each expert, tokens x topk / experts x this factor; pairs beyond it "
             "are dropped (unset: dropless).")
    moe_token_drop_policy: str = flag(
        "probs", group="moe", choices=["probs", "position"],
        help="Beyond capacity drop the lowest-probability pairs (probs) or the latest tokens "
             "(position).")
    moe_pad_expert_input_to_capacity: bool = flag(
        False, group="moe", help="Pad each expert's input to its capacity (needs "
                                 "--moe-expert-capacity-factor).")
    moe_grouped_gemm: bool = flag(
        False, group="moe",
        help="Run the experts as grouped GEMMs (torch._grouped_mm) instead of a loop over "
             "experts. One kernel for bf16 on sm_90 (and sm_100 from torch 2.9); elsewhere "
             "torch 2.9+ loops over the experts (said at the start) and torch 2.8 cannot run it "
             "(refused).")
    # flex is parsed to be refused by name (validation/moe.py).
    moe_token_dispatcher_type: str = flag(
        "allgather", group="moe", choices=["allgather", "alltoall", "flex"],
        help="How tokens reach the experts of other EP ranks: allgather or alltoall. flex is "
             "Megatron's (DeepEP) and not built.")

    def loss_compiled(self, layers_compiled: bool, tp_size: int) -> bool:
        """Whether the loss runs under torch.compile: with compiled layers or
        --cross-entropy-loss-fusion, where one rank holds the whole vocabulary (TP 1; over
        a TP group it is the eager vocab-parallel one, whose all-reduces a graph would
        break on). The model builds it so and the memory planner plans it so."""
        return (layers_compiled or self.cross_entropy_loss_fusion) and tp_size == 1

    @property
    def masks_documents(self) -> bool:
        """Attention is block-causal over the documents of each sample."""
        return self.reset_attention_mask or self.dataloader_inter_document_masking

    @property
    def resets_positions(self) -> bool:
        """Positions restart at each document."""
        return self.reset_position_ids or self.dataloader_inter_document_masking

    @property
    def uses_documents(self) -> bool:
        """The model reads each sample's document starts (the batch's "document_starts")."""
        return self.masks_documents or self.resets_positions

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def mtp_depths(self) -> int:
        """D, the MTP modules (0 without --mtp-num-layers)."""
        return self.mtp_num_layers or 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer`'s MLP is a MoE layer (moe_layer_pattern)."""
        return self.moe_layer_pattern is not None and bool(self.moe_layer_pattern[layer])
