"""Activations of one pipeline rank: what megalite's modules save for backward per
micro-batch, walked through the rank's schedule. docs/memory.md derives each count (s
sequence, b micro-batch, h hidden, t TP, f MLP width, q/k query/KV projection widths).
The recompute groups are the model's own (`model.gpt.recompute_groups`), the stages
`pipeline_parallel.stages`, the schedule the action list the executor runs."""

from dataclasses import dataclass

from megalite.config import Config
from megalite.memory_estimate.context_parallel import (attended_keys, cp_attention_working_set,
                                                       cp_core_attention_bytes,
                                                       gathered_qkv_bytes, ring_keeps_qkv)
from megalite.memory_estimate.weights import param_bytes_per_element
from megalite.model.gpt import recompute_groups
from megalite.pipeline_parallel.p2p import communication_plan
from megalite.pipeline_parallel.schedules import BACKWARD, FORWARD, WEIGHT, build_schedule
from megalite.pipeline_parallel.stages import rank_stages


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


DEVICES = {"cuda": Device("cuda", True, True, True),
           "cpu": Device("cpu", False, False, False)}


@dataclass(frozen=True)
class _Shapes:
    s: int
    b: int
    h: int
    seq: int
    """Rows of the residual stream on this rank: s / TP under SP, else s."""
    sp: bool
    a: int
    """Bytes per activation element (the parameters' dtype)."""
    mixed: bool
    q: int
    kv: int
    heads: int
    f: int
    vocab: int
    """Padded vocabulary / TP."""
    tp: int
    device: Device
    cp: int = 1
    """Context-parallel ranks: s is then this rank's s / CP rows (context_parallel.py)."""

    def mask(self, dropout: float) -> int:
        """Bytes per element of a dropout mask (0 without dropout)."""
        if dropout <= 0.0:
            return 0
        return 1 if self.device.dropout_mask_is_bool else self.a


def _shapes(config: Config, device: Device) -> _Shapes:
    m, par = config.model, config.parallel
    t, a = par.tensor_model_parallel_size, param_bytes_per_element(config)
    s = m.seq_length // par.context_parallel_size
    return _Shapes(s=s, b=config.training.micro_batch_size, h=m.hidden_size,
                   seq=s // t if m.sequence_parallel else s, sp=m.sequence_parallel,
                   a=a, mixed=a == 2, q=m.query_projection_size // t,
                   kv=m.kv_projection_size // t, heads=m.num_attention_heads // t,
                   f=m.ffn_hidden_size // t, vocab=m.padded_vocab_size // t, tp=t,
                   device=device, cp=par.context_parallel_size)


# One transformer layer, the embedding, the loss (docs/memory.md, "What one layer saves").

def norm_saved_bytes(config: Config, x: _Shapes) -> int:
    """LayerNorm: its input and mean/rstd; RMSNorm (in fp32): the fp32 input, normalised
    values and rsqrt, plus an fp32 copy of its weight."""
    rows = x.seq * x.b
    if config.model.normalization == "RMSNorm":
        weight = 4 * x.h if x.a != 4 else 0
        return 4 * rows * x.h * 2 + 4 * rows + weight
    e = 4 if (x.mixed and x.device.autocast_fp32_norm_softmax) else x.a
    return e * rows * x.h + 2 * e * rows


def norm_output_bytes(config: Config, x: _Shapes) -> int:
    """The input the column-parallel linear reading one norm's output saves (QKV, or the
    fused fc1): the gathered [s, b, h] under SP, else the norm output or, for RMSNorm on
    the embedding's transposed stream, its contiguous copy: one [s, b, h] either way."""
    return x.a * x.s * x.b * x.h


def qkv_saved_bytes(config: Config, x: _Shapes, kernel_keeps_qkv: bool = True) -> int:
    """Q, K and V as the attention keeps them (the fused QKV output, rotated or GQA
    copies). RoPE's cos/sin table is the model's, read by every layer: not an activation."""
    m = config.model
    sb = x.s * x.b
    rope = m.position_embedding_type == "rope"
    q_is_copy = rope or m.num_attention_heads != m.num_query_groups
    fused = x.a * sb * (x.q + 2 * x.kv)
    if kernel_keeps_qkv:
        copies = x.a * sb * (x.q + x.kv if rope else x.q if q_is_copy else 0)
        return fused + copies
    if x.mixed:
        return 0
    return x.a * sb * x.q if q_is_copy else fused


def core_attention_bytes(config: Config, x: _Shapes) -> int:
    """What the attention kernel saves beyond Q, K and V: what selective recompute drops."""
    if x.cp > 1 and (cp := cp_core_attention_bytes(config, x)) is not None:
        return cp
    if config.model.attention_backend != "unfused":
        out = x.a * x.s * x.b * x.q if x.device.attention_output_copied else 0
        return 4 * x.b * x.heads * x.s + out  # + the fp32 log-sum-exp
    return _unfused_attention_bytes(config, x)


def _unfused_attention_bytes(config: Config, x: _Shapes) -> int:
    """attention_backends._unfused: repeated K and V, Q's cast, the mask, the s x s
    probabilities, dropout's mask and output, the probabilities cast for the matmul."""
    p = config.model.attention_dropout
    keys, pairs = attended_keys(x)
    bsq, probs = x.b * x.s * x.q, x.b * x.heads * pairs
    softmax = 4 if (not x.mixed or x.device.autocast_fp32_norm_softmax) else x.a
    total = 2 * x.a * x.b * keys * x.q + pairs + softmax * probs  # K, V repeated, mask, softmax
    if x.mixed:
        total += x.a * bsq  # Q cast back to bf16/fp16 for the matmul
    if p > 0:
        total += (1 if x.device.dropout_mask_is_bool else softmax) * probs
        total += softmax * probs  # dropout output, read by the second matmul
    if softmax != x.a:
        total += x.a * probs  # probs.to(v.dtype)
    return total


def attention_saved_bytes(config: Config, x: _Shapes, selective: bool) -> int:
    """Self-attention after its norm: QKV, the kernel's state, the output projection's
    input [s, b, q] and the residual dropout's mask."""
    kernel_keeps_qkv = (selective or config.model.attention_backend != "unfused"
                        or ring_keeps_qkv(config, x))
    qkv = None if selective else gathered_qkv_bytes(config, x)
    if qkv is None:
        qkv = qkv_saved_bytes(config, x, kernel_keeps_qkv)
    total = qkv + x.a * x.s * x.b * x.q
    if not selective:
        total += core_attention_bytes(config, x)
    return total + x.mask(config.model.hidden_dropout) * x.seq * x.b * x.h


def mlp_saved_bytes(config: Config, x: _Shapes) -> int:
    """GeLU: fc1's output and the GeLU output; SwiGLU: gate, silu(gate), up and their
    product; then the residual dropout's mask."""
    tensors = 4 if config.model.swiglu else 2
    return (tensors * x.a * x.s * x.b * x.f
            + x.mask(config.model.hidden_dropout) * x.seq * x.b * x.h)


def layer_saved_bytes(config: Config, x: _Shapes) -> int:
    """One transformer layer, without recompute or with selective recompute."""
    selective = config.model.recompute_granularity == "selective"
    return (2 * norm_saved_bytes(config, x)
            + norm_output_bytes(config, x)
            + attention_saved_bytes(config, x, selective)
            + norm_output_bytes(config, x)
            + mlp_saved_bytes(config, x))


def layer_activation_bytes(config: Config, device: Device) -> tuple[int, int]:
    """(what one transformer layer saves for backward per micro-batch on this rank, the
    context-parallel buffers it holds on top in its backward): the per-layer figures of
    benchmarks/cp_memory.py."""
    x = _shapes(config, device)
    return layer_saved_bytes(config, x), cp_attention_working_set(config, x)


def embedding_saved_bytes(config: Config, x: _Shapes) -> int:
    """Token ids (int64; under TP the shard-local ids and the out-of-shard mask) for the
    embedding's backward, position ids, and the embedding dropout's mask."""
    total = 8 * x.b * x.s + (x.b * x.s if x.tp > 1 else 0)
    if config.model.position_embedding_type == "learned_absolute":
        total += 8 * x.s
    return total + x.mask(config.model.hidden_dropout) * x.seq * x.b * x.h


def loss_saved_bytes(config: Config, x: _Shapes) -> int:
    """Final norm, the output layer's input, and the vocab-parallel cross-entropy's fp32
    softmax [s, b, V/t] with its target ids and out-of-shard mask."""
    return (norm_saved_bytes(config, x) + norm_output_bytes(config, x)
            + 4 * x.s * x.b * x.vocab + 8 * x.s * x.b + x.s * x.b)


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


def chunk_activations(config: Config, x: _Shapes, num_layers: int, pre: bool,
                      post: bool) -> ChunkActivations:
    contiguous = x.sp or not pre
    layer = layer_saved_bytes(config, x)
    residual = x.a * x.seq * x.b * x.h
    saved, working = 0, cp_attention_working_set(config, x)
    for run, recomputed in recompute_groups(config.model, num_layers):
        if recomputed:
            saved += residual  # the group's input, kept by the checkpoint
            working = max(working, len(run) * layer + cp_attention_working_set(config, x))
        else:
            saved += len(run) * layer
    if pre:
        saved += embedding_saved_bytes(config, x)
    else:
        saved += 0 if _first_layer_keeps_input(config, x) else residual  # received input
    if post:
        saved += loss_saved_bytes(config, x)
    elif not contiguous:
        saved += residual  # the output [b, s, h] view; its contiguous copy is sent
    return ChunkActivations(saved, 0 if post else residual, 0 if pre else residual, working)


def _first_layer_keeps_input(config: Config, x: _Shapes) -> bool:
    """Whether the first layer itself saves the tensor received from the previous stage
    (a checkpointed group, a LayerNorm in the activation dtype, an fp32 RMSNorm), so that
    holding it costs nothing more."""
    if recompute_groups(config.model, 1)[0][1]:
        return True
    if config.model.normalization == "RMSNorm":
        return x.a == 4
    return not (x.mixed and x.device.autocast_fp32_norm_softmax)


def rank_chunks(config: Config, pp_rank: int, device: Device) -> list[ChunkActivations]:
    par = config.parallel
    x = _shapes(config, device)
    return [chunk_activations(config, x, len(stage.layers(config.model.num_layers)),
                              stage.is_first, stage.is_last)
            for stage in rank_stages(pp_rank, par.pipeline_model_parallel_size,
                                     par.virtual_pipeline_model_parallel_size or 1)]


def activation_bytes(config: Config, pp_rank: int, device: Device) -> tuple[int, int, int]:
    """(one micro-batch through every chunk of this rank, the peak over the step, the p2p
    buffers held at that peak). The peak walks this rank's schedule: a forward adds its
    chunk's saved tensors and its send buffer, a backward first rebuilds a recomputed
    group (working set), then frees the saved tensors and sends the input gradient.
    A send in a batch with a receive is let go once the batch is done (p2p.py), so the
    sent output lives until its backward (the executor keeps it for that; for a copy an
    upper bound) and the sent input gradient no longer than its backward; a send in a
    batch of sends only stays until the step ends (`sends_held`). Under a split backward
    (zb-h1) the saved tensors count until the micro-batch's W: an upper bound, as B frees
    all but the linear layers' inputs, which W keeps with their output gradients."""
    chunks = rank_chunks(config, pp_rank, device)
    par, m = config.parallel, config.training.num_microbatches
    schedule = build_schedule(par.pipeline_model_parallel_size, pp_rank, m, len(chunks),
                              par.pipeline_schedule)
    split = any(a.kind == WEIGHT for a in schedule)
    held = sends_held(config, pp_rank)
    live = sent = peak = peak_sent = 0
    until_backward = {}  # (microbatch, chunk) -> its sent output, let go at its backward
    for action, keep in zip(schedule, held):
        c, key = chunks[action.chunk], (action.microbatch, action.chunk)
        if action.kind == FORWARD:
            live += c.saved
            sent += c.send_forward
            until_backward[key] = 0 if keep else c.send_forward
            now = live + sent
        elif action.kind == WEIGHT:
            now = live + sent
            live -= c.saved
        else:
            now = live + sent + c.working_set
            live -= 0 if split else c.saved
            sent += (c.send_backward if keep else 0) - until_backward.pop(key)
        if now > peak:
            peak, peak_sent = now, sent
    return sum(c.saved for c in chunks), peak, peak_sent


def sends_held(config: Config, pp_rank: int) -> list[bool]:
    """Per action of this rank's schedule, whether its send stays held until the step
    ends (p2p.RankPlan.sends_held, from every rank's plan); nothing is sent without PP."""
    par = config.parallel
    p, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    schedules = [build_schedule(p, r, config.training.num_microbatches, v,
                                par.pipeline_schedule) for r in range(p)]
    if p == 1:
        return [False] * len(schedules[0])
    return communication_plan(schedules, v)[pp_rank].sends_held()


def microbatches_in_flight(pp_size: int, pp_rank: int, num_microbatches: int,
                           num_chunks: int = 1, schedule: str = "1f1b") -> int:
    """Most (micro-batch, chunk) forwards whose backward (W, when split) has not run yet
    on this rank."""
    actions = build_schedule(pp_size, pp_rank, num_microbatches, num_chunks, schedule)
    done = WEIGHT if any(a.kind == WEIGHT for a in actions) else BACKWARD
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1 if action.kind == done else 0
        peak = max(peak, live)
    return peak
