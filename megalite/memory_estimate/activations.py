"""Activations of one pipeline rank: what megalite's modules save for backward per
micro-batch, walked through the rank's schedule. docs/memory.md derives each count in its
letters ([s, b, h] an activation: sequence, micro-batch, hidden; t TP, f MLP width, q/k
query/KV projection widths), which `_Shapes` holds under their names.
The recompute groups are the model's own (`model.gpt.recompute_groups`), the stages
`pipeline_parallel.stages`; schedule.py walks the rank's schedule over these chunks."""

from dataclasses import dataclass

from megalite.config import Config
from megalite.memory_estimate.context_parallel import (attended_keys, cp_attention_working_set,
                                                       cp_core_attention_bytes,
                                                       gathered_qkv_bytes, ring_keeps_qkv)
from megalite.memory_estimate.documents import (gather_index_bytes, pads_documents,
                                               padded_attention_bytes, rope_table_bytes)
from megalite.memory_estimate.fp8 import fp8_layer_delta_bytes, fp8_weight_copy_bytes
from megalite.memory_estimate.mla import mla_saved_bytes, qk_norm_saved_bytes
from megalite.memory_estimate.moe import moe_saved_bytes
from megalite.model.gpt import recompute_groups
from megalite.pipeline_parallel.stages import rank_stages
from megalite.tensor_parallel.fp8 import layer_fp8_recipe


@dataclass(frozen=True)
class Device:
    """How one device type's kernels store what backward needs."""
    name: str
    dropout_mask_is_bool: bool
    """CUDA's fused dropout keeps a bool mask; the CPU keeps the scaled noise tensor."""
    autocast_fp32_norm_softmax: bool
    """CUDA autocast runs layer_norm and softmax in fp32 (CPU autocast does not)."""
    attention_output_copied: bool
    """The flash/SDPA output is [b, s, heads, d] contiguous, so turning it into the
    [s, b, heads*d] input of the output projection copies it."""
    sdpa_takes_unequal_heads: bool
    """SDPA's fused kernels take V heads of another size than Q/K's (multi-latent
    attention): CUDA's memory-efficient one does; the CPU's flash kernel does not."""


DEVICES = {"cuda": Device("cuda", True, True, True, True),
           "cpu": Device("cpu", False, False, False, False)}


@dataclass(frozen=True)
class _Shapes:
    """One micro-batch on one rank: each width is one TP rank's share."""
    seq: int
    """Sequence rows of an activation, s: --seq-length / CP."""
    micro_batch: int
    """Sequences per micro-batch, b (--micro-batch-size)."""
    hidden: int
    """Hidden size, h."""
    residual_seq: int
    """Rows of the residual stream: seq / TP under SP, else seq."""
    act_bytes: int
    """Bytes per activation element (the parameters' dtype)."""
    mixed: bool
    """bf16/fp16 activations (act_bytes 2)."""
    query_width: int
    """Query projection width / TP, q: heads x kv_channels / TP."""
    kv_width: int
    """Key (and value) projection width / TP, k: query groups x kv_channels / TP."""
    heads: int
    """Attention heads / TP."""
    ffn_width: int
    """MLP hidden width / TP, f / t."""
    vocab: int
    """Padded vocabulary / TP."""
    tp: int
    device: Device
    cp: int = 1
    """Context-parallel ranks: seq is then this rank's s / CP rows (context_parallel.py)."""
    compiled: bool = False
    """The transformer layers run under torch.compile (Config.layers_compiled)."""

    @property
    def tokens(self) -> int:
        """Rows of an [s, b, .] activation."""
        return self.seq * self.micro_batch

    @property
    def residual_tokens(self) -> int:
        """Rows of the residual stream's [s/t, b, h] (under SP) or [s, b, h]."""
        return self.residual_seq * self.micro_batch

    def mask(self, dropout: float) -> int:
        """Bytes per element of a dropout mask (0 without dropout)."""
        if dropout <= 0.0:
            return 0
        return 1 if self.device.dropout_mask_is_bool else self.act_bytes


def _shapes(config: Config, device: Device) -> _Shapes:
    m, par = config.model, config.parallel
    t, a = par.tensor_model_parallel_size, config.precision.params_bytes
    s = m.seq_length // par.context_parallel_size
    return _Shapes(seq=s, micro_batch=config.training.micro_batch_size, hidden=m.hidden_size,
                   residual_seq=s // t if m.sequence_parallel else s, act_bytes=a, mixed=a == 2,
                   query_width=m.query_projection_size // t,
                   kv_width=m.kv_projection_size // t, heads=m.num_attention_heads // t,
                   ffn_width=m.ffn_hidden_size // t, vocab=m.padded_vocab_size // t, tp=t,
                   device=device, cp=par.context_parallel_size,
                   compiled=config.layers_compiled(device.name))


# One transformer layer, the embedding, the loss (docs/memory.md, "What one layer saves").

def norm_saved_bytes(config: Config, shape: _Shapes, width: int | None = None,
                     rows: int | None = None) -> int:
    """LayerNorm: its input and mean/rstd; RMSNorm (in fp32): the fp32 input, normalised
    values and rsqrt, plus an fp32 copy of its weight. Over `rows` x `width` (default: the
    residual stream's [R, h]; a latent or per-head norm's otherwise)."""
    rows = shape.residual_tokens if rows is None else rows
    width = width or shape.hidden
    if config.model.normalization == "RMSNorm":
        weight = 4 * width if shape.act_bytes != 4 else 0
        return 4 * rows * width * 2 + 4 * rows + weight
    fp32 = shape.mixed and shape.device.autocast_fp32_norm_softmax
    element = 4 if fp32 else shape.act_bytes
    return element * rows * width + 2 * element * rows


def norm_output_bytes(config: Config, shape: _Shapes) -> int:
    """The input the column-parallel linear reading one norm's output saves (QKV, or the
    fused fc1): the gathered [s, b, h] under SP, else the norm output or, for RMSNorm on
    the embedding's transposed stream, its contiguous copy: one [s, b, h] either way."""
    return shape.act_bytes * shape.tokens * shape.hidden


def qkv_saved_bytes(config: Config, shape: _Shapes, kernel_keeps_qkv: bool = True) -> int:
    """Q, K and V as the attention keeps them (the fused QKV output, rotated or GQA
    copies). RoPE's cos/sin table is the model's, read by every layer: not an activation."""
    model = config.model
    q, kv = shape.query_width, shape.kv_width
    rope = model.position_embedding_type == "rope"
    q_is_copy = rope or model.num_attention_heads != model.num_query_groups
    fused = shape.act_bytes * shape.tokens * (q + 2 * kv)
    if kernel_keeps_qkv:
        copies = shape.act_bytes * shape.tokens * (q + kv if rope else q if q_is_copy else 0)
        return fused + copies
    if shape.mixed:
        return 0
    return shape.act_bytes * shape.tokens * q if q_is_copy else fused


def core_attention_bytes(config: Config, shape: _Shapes) -> int:
    """What the attention kernel saves beyond Q, K and V: what selective recompute drops."""
    if shape.cp > 1 and (cp := cp_core_attention_bytes(config, shape)) is not None:
        return cp
    if pads_documents(config, shape):
        return padded_attention_bytes(config, shape)
    if config.model.attention_backend != "unfused":
        copied = shape.device.attention_output_copied
        out = shape.act_bytes * shape.tokens * shape.query_width if copied else 0
        return 4 * shape.heads * shape.tokens + out  # + the fp32 log-sum-exp
    return _unfused_attention_bytes(config, shape)


def _unfused_attention_bytes(config: Config, shape: _Shapes) -> int:
    """attention_backends._unfused: repeated K and V, Q's cast, the mask, the s x s
    probabilities, dropout's mask and output, the probabilities cast for the matmul. The
    mask is each sample's own [s, s] with documents, else one causal [s, s]."""
    dropout, act_bytes = config.model.attention_dropout, shape.act_bytes
    keys, pairs = attended_keys(shape)
    probs = shape.micro_batch * shape.heads * pairs
    masks = shape.micro_batch * pairs if config.model.masks_documents else pairs
    fp32 = not shape.mixed or shape.device.autocast_fp32_norm_softmax
    softmax = 4 if fp32 else act_bytes
    repeated_kv = 2 * act_bytes * shape.micro_batch * keys * shape.query_width
    total = repeated_kv + masks + softmax * probs  # K, V repeated, mask, softmax
    if shape.mixed:
        total += act_bytes * shape.tokens * shape.query_width  # Q cast back for the matmul
    if dropout > 0:
        total += (1 if shape.device.dropout_mask_is_bool else softmax) * probs
        total += softmax * probs  # dropout output, read by the second matmul
    if softmax != act_bytes:
        total += act_bytes * probs  # probs.to(v.dtype)
    return total


def attention_saved_bytes(config: Config, shape: _Shapes, selective: bool) -> int:
    """Self-attention after its norm: QKV, the kernel's state, the output projection's
    input [s, b, q] and the residual dropout's mask. The padded document path keeps its own
    gathered copies of Q, K and V (core_attention_bytes), none of the fused QKV output."""
    kernel_keeps_qkv = (selective or config.model.attention_backend != "unfused"
                        or ring_keeps_qkv(config, shape))
    qkv = None if selective else gathered_qkv_bytes(config, shape)
    if qkv is None:
        padded = pads_documents(config, shape) and not selective
        qkv = 0 if padded else qkv_saved_bytes(config, shape, kernel_keeps_qkv)
    total = qkv + shape.act_bytes * shape.tokens * shape.query_width
    if not selective:
        total += core_attention_bytes(config, shape)
    return total + shape.mask(config.model.hidden_dropout) * shape.residual_tokens * shape.hidden


def mlp_saved_bytes(config: Config, shape: _Shapes) -> int:
    """GeLU: fc1's output and the GeLU output; SwiGLU: gate, silu(gate), up and their
    product; then the residual dropout's mask."""
    tensors = 4 if config.model.swiglu else 2
    return (tensors * shape.act_bytes * shape.tokens * shape.ffn_width
            + shape.mask(config.model.hidden_dropout) * shape.residual_tokens * shape.hidden)


def layer_saved_bytes(config: Config, shape: _Shapes, layer: int = 0) -> int:
    """One transformer layer (global index `layer`), without recompute or with selective
    recompute; its linear layers' GEMMs in FP8 with its recipe (layer_fp8_recipe); a MoE
    layer's MLP as memory_estimate/moe.py counts it; a compiled layer as
    compiled_layer_saved_bytes does where that count holds (plans_compiled)."""
    if plans_compiled(config, shape, layer):
        return compiled_layer_saved_bytes(config, shape)
    selective = config.model.recompute_granularity == "selective"
    mlp = (moe_saved_bytes(config, shape) if config.model.is_moe_layer(layer)
           else mlp_saved_bytes(config, shape))
    if config.model.multi_latent_attention:  # its input included (memory_estimate/mla.py)
        attention = mla_saved_bytes(config, shape, selective, norm_saved_bytes,
                                    core_attention_bytes)
    else:
        attention = (norm_output_bytes(config, shape) + attention_saved_bytes(
            config, shape, selective) + qk_norm_saved_bytes(config, shape, norm_saved_bytes))
    return (2 * norm_saved_bytes(config, shape) + norm_output_bytes(config, shape)
            + attention + mlp + fp8_layer_delta_bytes(config, shape, layer))


def plans_compiled(config: Config, shape: _Shapes, layer: int) -> bool:
    """Whether layer `layer` is counted as compiled: it is (shape.compiled), and it is one
    of the variants whose compiled saved tensors were measured (the layers compiled by
    default: TP 1, CP 1, a dense MLP), without FP8 GEMMs, the `unfused` attention
    or document masks (whose attention dynamo does not trace: _document_attention).
    Other compiled layers keep the eager count, which is above the compiled one in every
    variant measured (multi-latent attention's compiled layer is not measured: eager count).
    (Selective recompute never compiles: config.compile_by_default leaves it out and
    validation refuses it with --compile-layers.)"""
    m = config.model
    return (shape.compiled and shape.tp == 1 and shape.cp == 1
            and layer_fp8_recipe(m, layer) is None
            and not m.is_moe_layer(layer) and m.attention_backend != "unfused"
            and not m.masks_documents and not m.multi_latent_attention)


def compiled_layer_saved_bytes(config: Config, shape: _Shapes) -> int:
    """One transformer layer under torch.compile: what inductor's min-cut partitioner
    (torch._functorch.partitioners.min_cut_rematerialization_partition) keeps between the
    forward and backward graphs. It saves the cheapest set that lets backward recompute
    the rest, so it keeps the GEMM and attention inputs and outputs and recomputes the
    elementwise work between them (RMSNorm's fp32 copies, silu(gate), GeLU, RoPE's
    intermediates, the residual sums). Kept: the layer's input and the output
    projection's output (the residual sum for the second norm is rebuilt from both), each
    norm's row statistics and output, Q, K, V as the attention kernel takes them with its
    output and fp32 log-sum-exp, fc1's output and fc2's input, the residual dropouts'
    bool masks (random draws are never recomputed). docs/memory.md, "Compiled layers"."""
    m = config.model
    a, rows, tokens = shape.act_bytes, shape.residual_tokens, shape.tokens
    residual = 2 * a * rows * shape.hidden
    norms = 2 * (_norm_statistics_bytes(config, shape) + norm_output_bytes(config, shape))
    attention = (qkv_saved_bytes(config, shape) + a * tokens * shape.query_width
                 + 4 * shape.heads * tokens)
    mlp = (3 if m.swiglu else 2) * a * tokens * shape.ffn_width
    masks = 2 * rows * shape.hidden if m.hidden_dropout > 0 else 0
    return residual + norms + attention + mlp + masks


def _norm_statistics_bytes(config: Config, shape: _Shapes) -> int:
    """A compiled norm's row statistics: RMSNorm's fp32 rsqrt; LayerNorm's mean and rstd,
    in fp32 where the norm runs in fp32 (fp32 activations, CUDA autocast), else in the
    activation dtype (its decomposition casts them back)."""
    if config.model.normalization == "RMSNorm":
        return 4 * shape.residual_tokens
    fp32 = not shape.mixed or shape.device.autocast_fp32_norm_softmax
    return 2 * (4 if fp32 else shape.act_bytes) * shape.residual_tokens


def layer_activation_bytes(config: Config, device: Device) -> tuple[int, int]:
    """(what one transformer layer saves for backward per micro-batch on this rank, the
    context-parallel buffers it holds on top in its backward): the per-layer figures of
    benchmarks/cp_memory.py."""
    shape = _shapes(config, device)
    return layer_saved_bytes(config, shape), cp_attention_working_set(config, shape)


def embedding_saved_bytes(config: Config, shape: _Shapes) -> int:
    """Token ids (int64; under TP the shard-local ids and the out-of-shard mask) for the
    embedding's backward, position ids ([s], or [b, s] when they restart per document),
    and the embedding dropout's mask."""
    total = 8 * shape.tokens + (shape.tokens if shape.tp > 1 else 0)
    if config.model.position_embedding_type == "learned_absolute":
        total += 8 * (shape.tokens if config.model.resets_positions else shape.seq)
    return total + shape.mask(config.model.hidden_dropout) * shape.residual_tokens * shape.hidden


def loss_saved_bytes(config: Config, shape: _Shapes) -> int:
    """Final norm, the output layer's input, and the loss: the eager vocab-parallel
    cross-entropy's fp32 softmax [s, b, V/t] with its target ids and out-of-shard mask, or
    the compiled one's (GPTConfig.loss_compiled) logits in their own dtype, target ids, and
    two fp32 numbers a token (the max and the log-sum-exp: inductor's partition)."""
    head = norm_saved_bytes(config, shape) + norm_output_bytes(config, shape)
    if config.model.loss_compiled(shape.compiled, shape.tp):
        return head + shape.act_bytes * shape.tokens * shape.vocab + 16 * shape.tokens
    return head + 4 * shape.tokens * shape.vocab + 8 * shape.tokens + shape.tokens


def mtp_depth_saved_bytes(config: Config, shape: _Shapes) -> int:
    """One multi-token prediction depth (model/mtp.py) on the last stage: the embedding of
    the tokens k ahead, enorm and hnorm, eh_proj's input [s, b, 2h] (the two norms' outputs
    concatenated, gathered under SP), the transformer layer (of the last layer's kind, never
    recomputed) and the head: final norm, output layer input and loss as loss_saved_bytes."""
    layer = config.model.num_layers - 1
    return (embedding_saved_bytes(config, shape) + 2 * norm_saved_bytes(config, shape)
            + 2 * norm_output_bytes(config, shape) + layer_saved_bytes(config, shape, layer)
            + loss_saved_bytes(config, shape))


# Recompute, chunks, and the pipeline schedule.

@dataclass(frozen=True)
class ChunkActivations:
    """One micro-batch through one model chunk."""
    saved: int
    """Saved for backward, plus the chunk input and output the executor holds."""
    send_forward: int
    """Bytes of the output sent to the next stage (activation_bytes says how long held)."""
    send_backward: int
    """Bytes of the input gradient sent to the previous stage (likewise)."""
    working_set: int
    """Recomputed in backward on top of `saved` (full recompute: one group)."""
    fp8_weights: int = 0
    """FP8 copies of the chunk's weights: held once a step, not per micro-batch
    (memory_estimate/fp8.py)."""


def chunk_activations(config: Config, shape: _Shapes, layers: range, pre: bool,
                      post: bool) -> ChunkActivations:
    """`layers`: the chunk's transformer layers (global indices)."""
    contiguous = config.model.sequence_parallel or not pre
    residual = shape.act_bytes * shape.residual_tokens * shape.hidden
    saved, working = rope_table_bytes(config, shape), cp_attention_working_set(config, shape)
    fp8_weights = sum(fp8_weight_copy_bytes(config, shape, i) for i in layers)
    groups = recompute_groups(config.model, len(layers))
    for run, recomputed in groups:
        run_bytes = sum(layer_saved_bytes(config, shape, layers[i]) for i in run)
        if recomputed:
            saved += residual  # the group's input, kept by the checkpoint
            working = max(working, run_bytes + cp_attention_working_set(config, shape))
        else:
            saved += run_bytes
    if not all(recomputed for _, recomputed in groups):
        saved += gather_index_bytes(config, shape)  # once a forward, for all its layers
    if pre:
        saved += embedding_saved_bytes(config, shape)
    else:
        saved += 0 if _first_layer_keeps_input(config, shape, layers[:1]) else residual
    if post:
        saved += (loss_saved_bytes(config, shape)
                  + config.model.mtp_depths * mtp_depth_saved_bytes(config, shape))
    elif not contiguous:
        saved += residual  # the output [b, s, h] view; its contiguous copy is sent
    return ChunkActivations(saved, 0 if post else residual, 0 if pre else residual, working,
                            fp8_weights)


def _first_layer_keeps_input(config: Config, shape: _Shapes, first: range) -> bool:
    """Whether the stage's first layer (`first`: its index, or none) itself saves the
    tensor received from the previous stage (a checkpointed group, a compiled layer, a
    LayerNorm in the activation dtype, an fp32 RMSNorm), so that holding it costs nothing
    more."""
    compiled = any(plans_compiled(config, shape, i) for i in first)
    if recompute_groups(config.model, 1)[0][1] or compiled:
        return True  # a checkpoint keeps its input; so does a compiled layer (above)
    if config.model.normalization == "RMSNorm":
        return shape.act_bytes == 4
    return not (shape.mixed and shape.device.autocast_fp32_norm_softmax)


def rank_chunks(config: Config, pp_rank: int, device: Device) -> list[ChunkActivations]:
    par = config.parallel
    shape = _shapes(config, device)
    return [chunk_activations(config, shape, stage.layers(config.model.num_layers),
                              stage.is_first, stage.is_last)
            for stage in rank_stages(pp_rank, par.pipeline_model_parallel_size,
                                     par.virtual_pipeline_model_parallel_size or 1,
                                     par.pipeline_layer_counts)]
