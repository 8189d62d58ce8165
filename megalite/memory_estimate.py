"""Per-rank memory of a megalite training run, planned from its flags (issue 8).

`estimate_memory(config)` takes the validated `Config` and returns, for every pipeline
rank, the bytes one GPU of that rank holds at the peak of a training step, by component:

- parameters: the rank's TP shard of its pipeline chunks, in the parameters' dtype (bf16
  or fp16 with --bf16/--fp16, else fp32). Norm weights and row-parallel biases are whole
  on every TP rank; the word embeddings live on the first stage, the output layer on the
  last (a tied one there too when the pipeline has several stages); the vocabulary is
  padded as `pad_vocab_size` pads it. Under the distributed optimizer the parameters are
  views into flat buffers laid out like the gradient buckets (padding included).
- gradients: megalite's contiguous gradient buffer (distributed/grad_buffer.py), in the
  parameters' dtype or fp32 with --accumulate-allreduce-grads-in-fp32; buckets padded to
  a multiple of DP.
- optimizer state: `DistributedOptimizer` (with --use-distributed-optimizer, or bf16/fp16
  parameters) keeps an fp32 main copy and two fp32 Adam moments of the elements this DP
  rank owns: 12 bytes each, the whole model without ZeRO, 1/DP of every bucket with it
  (Rajbhandari et al. 2020, K = 12). Plain fp32 AdamW keeps only the two moments (the
  parameters are the main copy): 8 bytes per parameter.
- main grads: the optimizer step reads each owned gradient as `flat.float()`. From a
  bf16/fp16 buffer that is a new fp32 tensor, 4 bytes per owned element, kept from one
  step to the next; from an fp32 buffer it is a view and costs nothing.
- activations: the tensors autograd saves for backward, per micro-batch, as megalite's
  modules actually save them (below), times the micro-batches in flight at the peak of
  this rank's pipeline schedule, plus the p2p send buffers the executor holds until the
  end of the step, plus, under full recompute, one recomputed group's working set.

What one transformer layer saves (s sequence, b micro-batch, h hidden, t TP, f MLP width,
q = heads x kv_channels, k = query groups x kv_channels, a bytes per activation; the
residual stream is [s/t, b, h] under sequence parallelism, else [s, b, h]):
- each norm: LayerNorm its input and mean/rstd; RMSNorm (computed in fp32) the fp32
  input, fp32 normalised values and the fp32 rsqrt;
- each column-parallel linear its input: under SP the all-gathered [s, b, h] (megalite
  keeps it instead of all-gathering again in backward, tensor_parallel/layers.py; SwiGLU's
  gate and up are one fused linear); without SP the norm output, or its contiguous copy;
- attention: the fused QKV output [s, b, q + 2k] (V is a view of it, so all of it stays),
  rotated copies of Q and K under RoPE (a copy of Q under GQA), the attention output and
  the flash/SDPA log-sum-exp [b, heads, s] in fp32; `unfused` adds the s x s softmax
  probabilities (and the dropout mask) per head;
- MLP: GeLU keeps fc1's output and the GeLU output ([s, b, f/t] each), SwiGLU four
  such tensors (fc1's [gate; up] output, silu(gate), their product);
- each residual dropout its mask.
Korthikanti et al. 2022 (eq. 2: sbh(34 + 5as/h)) count the same things for an unfused
fp16 GPT; megalite differs where its kernels do (no s x s scores under flash/SDPA, fp32
norm internals).

Recompute (Korthikanti et al. 2022 §4; Megatron's flags): `full` keeps only the input
[s(/t), b, h] of each recomputed group (uniform: groups of --recompute-num-layers layers;
block: the first --recompute-num-layers layers of each chunk, one by one) and rebuilds a
group's activations during its backward; `selective` recomputes the core attention, so
what the attention kernel saves beyond Q, K, V is not kept.

Devices differ in what their kernels save; `DEVICES` names the differences. CUDA (the
default): dropout keeps a 1-byte bool mask, autocast runs LayerNorm and softmax in fp32,
and the flash/SDPA kernels return a contiguous [b, s, heads, d] output, so the [s, b, q]
input of the output projection is a copy. CPU: dropout keeps its scaled noise in the
activation dtype, LayerNorm runs in the activation dtype, and the CPU SDPA output is laid
out so the projection input is a view. tests/test_memory_estimate.py checks the CPU model
against tensors measured in CPU runs.

Not counted: transient buffers (all-gather/reduce-scatter outputs, the logits' fp32
intermediates in the loss, gradients in flight in backward, the optimizer's foreach
temporaries), the CUDA context, NCCL buffers and allocator fragmentation: leave headroom.
"""

from dataclasses import dataclass

from megalite.config import Config
from megalite.distributed.data_parallel import buckets
from megalite.pipeline_parallel.schedules import FORWARD, build_schedule

GiB = 2 ** 30


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


@dataclass
class RankMemory:
    """Bytes one GPU of pipeline rank `pp_rank` (DP rank 0, any TP rank) holds at the peak."""
    pp_rank: int
    num_parameters: int
    parameters: int
    gradients: int
    optimizer_state: int
    """fp32 main parameters and Adam moments."""
    main_grads: int
    """fp32 copies of the owned gradients made by the optimizer step."""
    activations: int
    """Peak of saved activations + p2p send buffers + the recompute working set."""
    activations_per_microbatch: int
    """One micro-batch through every chunk of this rank, as saved for backward."""
    microbatches_in_flight: float
    """Most micro-batches whose backward has not run, in units of all v chunks."""
    p2p_buffers: int = 0
    """Part of `activations`: sent activations and gradients held until the step ends."""

    @property
    def weights_and_optimizer(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.main_grads

    @property
    def total(self) -> int:
        return self.weights_and_optimizer + self.activations


def estimate_memory(config: Config, device: str = "cuda") -> list[RankMemory]:
    """Memory of every pipeline rank (index = pipeline rank) at DP rank 0."""
    pp = config.parallel.pipeline_model_parallel_size
    return [estimate_rank_memory(config, r, device) for r in range(pp)]


def most_loaded_rank(config: Config, device: str = "cuda") -> RankMemory:
    return max(estimate_memory(config, device), key=lambda r: r.total)


def estimate_rank_memory(config: Config, pp_rank: int, device: str = "cuda") -> RankMemory:
    state = _weights_and_optimizer(config, pp_rank)
    per_mb, peak, p2p = activation_bytes(config, pp_rank, DEVICES[device])
    par = config.parallel
    v = par.virtual_pipeline_model_parallel_size or 1
    in_flight = microbatches_in_flight(par.pipeline_model_parallel_size, pp_rank,
                                       config.training.num_microbatches, v) / v
    return RankMemory(pp_rank, state["num_parameters"], state["parameters"],
                      state["gradients"], state["optimizer_state"], state["main_grads"],
                      peak, per_mb, in_flight, p2p)


# Parameters, gradients, optimizer state.

def param_bytes_per_element(config: Config) -> int:
    p = config.precision
    return 2 if (p.bf16 or p.fp16) else 4


def uses_distributed_optimizer(config: Config) -> bool:
    """training.build_optimizer's rule: fp32 main parameters for bf16/fp16 or ZeRO-1."""
    p = config.precision
    return config.parallel.use_distributed_optimizer or p.bf16 or p.fp16


@dataclass(frozen=True)
class _Param:
    """A parameter's size and dtype, enough for megalite's bucketing rule."""
    name: str
    size: int
    """Elements on this rank."""
    shared_embedding: bool = False
    tensor_parallel: bool = True
    """Split across TP ranks (False: whole on every TP rank)."""
    dtype: str = "param"
    """One dtype for all: megalite casts the whole model to --bf16/--fp16."""

    def numel(self) -> int:
        return self.size


def rank_parameters(config: Config, pp_rank: int) -> list[_Param]:
    """This rank's parameters (one TP shard) in `model.parameters()` order: chunk by
    chunk, each as GPTModel registers them (megalite/model/gpt.py)."""
    par = config.parallel
    p, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per_chunk = config.model.num_layers // (p * v)
    params = []
    for chunk in range(v):
        stage = chunk * p + pp_rank
        params += _chunk_parameters(config, per_chunk, stage == 0, stage == p * v - 1)
    return params


def _chunk_parameters(config: Config, num_layers: int, pre: bool, post: bool) -> list[_Param]:
    m, t = config.model, config.parallel.tensor_model_parallel_size
    tied = not m.untie_embeddings_and_output_weights
    vocab_shard = m.padded_vocab_size // t * m.hidden_size
    params = []
    if pre:
        params.append(_Param("word_embeddings", vocab_shard, tied))
        if m.position_embedding_type == "learned_absolute":
            params.append(_Param("position_embeddings", m.max_position_embeddings * m.hidden_size,
                                 tensor_parallel=False))
    for _ in range(num_layers):
        params += _layer_parameters(config)
    if post:
        params += _norm_parameters(config)
        if not (tied and pre):
            params.append(_Param("output_layer", vocab_shard, tied))
    return params


def _norm_parameters(config: Config) -> list[_Param]:
    h = config.model.hidden_size
    names = ["norm.weight"] + (["norm.bias"] if config.model.normalization == "LayerNorm" else [])
    return [_Param(name, h, tensor_parallel=False) for name in names]


def _layer_parameters(config: Config) -> list[_Param]:
    m, t = config.model, config.parallel.tensor_model_parallel_size
    h, bias = m.hidden_size, m.add_bias_linear
    qkv = (m.query_projection_size + 2 * m.kv_projection_size) // t
    q, f = m.query_projection_size // t, m.ffn_hidden_size // t

    def linear(name, rows, cols, bias_size, row_parallel=False):
        # A row-parallel layer's bias is added after the reduction: whole on every rank.
        return [_Param(name + ".weight", rows * cols)] + (
            [_Param(name + ".bias", bias_size, tensor_parallel=not row_parallel)]
            if bias else [])
    params = _norm_parameters(config)
    params += linear("linear_qkv", qkv, h, qkv) + linear("linear_proj", h, q, h, True)
    params += _norm_parameters(config)
    up = 2 if m.swiglu else 1  # SwiGLU's fc1 is [gate; up]
    params += linear("linear_fc1", up * f, h, up * f)
    return params + linear("linear_fc2", h, f, h, True)


def num_model_parameters(config: Config) -> int:
    """Distinct parameters of the whole model (a tied output layer counted once)."""
    t = config.parallel.tensor_model_parallel_size
    total = 0
    for r in range(config.parallel.pipeline_model_parallel_size):
        for q in rank_parameters(config, r):
            if not (q.name == "output_layer" and q.shared_embedding):
                total += q.size * (t if q.tensor_parallel else 1)
    return total


def grad_buckets(config: Config, params: list[_Param]) -> list[tuple[int, int]]:
    """(real elements, padded elements) of each gradient bucket: GradBuffer's layout."""
    par = config.parallel
    rest = [q for q in params if not q.shared_embedding]
    groups = buckets(rest, par.ddp_bucket_size) + [[q] for q in params if q.shared_embedding]
    dp = par.data_parallel_size
    return [(n, -(-n // dp) * dp) for n in (sum(q.size for q in g) for g in groups)]


def _weights_and_optimizer(config: Config, pp_rank: int) -> dict:
    params = rank_parameters(config, pp_rank)
    num = sum(q.size for q in params)
    layout = grad_buckets(config, params)
    padded = sum(n for _, n in layout)
    pbytes = param_bytes_per_element(config)
    grad_fp32 = config.parallel.accumulate_allreduce_grads_in_fp32
    gbytes = 4 if grad_fp32 else pbytes
    if uses_distributed_optimizer(config):
        dp = config.parallel.data_parallel_size if config.parallel.use_distributed_optimizer else 1
        # DP rank 0 owns the first 1/dp of every bucket, all of it real parameters.
        owned = sum(min(real, n // dp) for real, n in layout)
        return dict(num_parameters=num, parameters=pbytes * padded, gradients=gbytes * padded,
                    optimizer_state=12 * owned, main_grads=0 if gbytes == 4 else 4 * owned)
    return dict(num_parameters=num, parameters=pbytes * num, gradients=gbytes * padded,
                optimizer_state=8 * num, main_grads=0)


# Activations: one transformer layer, the embedding, the loss.

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

    def mask(self, dropout: float) -> int:
        """Bytes per element of a dropout mask (0 without dropout)."""
        if dropout <= 0.0:
            return 0
        return 1 if self.device.dropout_mask_is_bool else self.a


def _shapes(config: Config, device: Device) -> _Shapes:
    m, par = config.model, config.parallel
    t, s = par.tensor_model_parallel_size, m.seq_length
    return _Shapes(s=s, b=config.training.micro_batch_size, h=m.hidden_size,
                   seq=s // t if m.sequence_parallel else s, sp=m.sequence_parallel,
                   a=param_bytes_per_element(config), mixed=param_bytes_per_element(config) == 2,
                   q=m.query_projection_size // t, kv=m.kv_projection_size // t,
                   heads=m.num_attention_heads // t, f=m.ffn_hidden_size // t,
                   vocab=m.padded_vocab_size // t, tp=t, device=device)


def norm_saved_bytes(config: Config, x: _Shapes) -> int:
    """What one norm saves for backward: LayerNorm its input and mean/rstd (in fp32 under
    CUDA autocast, else in the activation dtype); RMSNorm (norms.py, in fp32) the fp32
    input, the fp32 normalised values and the rsqrt, plus an fp32 copy of its weight."""
    rows = x.seq * x.b
    if config.model.normalization == "RMSNorm":
        weight = 4 * x.h if x.a != 4 else 0
        return 4 * rows * x.h * 2 + 4 * rows + weight
    e = 4 if (x.mixed and x.device.autocast_fp32_norm_softmax) else x.a
    return e * rows * x.h + 2 * e * rows


def norm_output_bytes(config: Config, x: _Shapes, consumers: int, contiguous: bool) -> int:
    """What the column-parallel linears reading one norm's output save as their input.
    Under SP each gathers [s, b, h] itself. Otherwise one shared tensor when the norm
    output can be used as is (LayerNorm returns a contiguous tensor), else one copy per
    linear: RMSNorm keeps the residual stream's layout, which is [b, s, h] in memory on
    the embedding's stage (a transposed view). (LayerNorm casts its fp32 output under CUDA
    autocast back to bf16/fp16 itself, norms.py.)"""
    full = x.a * x.s * x.b * x.h
    if x.sp:
        return consumers * full
    shared = config.model.normalization == "LayerNorm" or contiguous
    return full if shared else consumers * full


def qkv_saved_bytes(config: Config, x: _Shapes, kernel_keeps_qkv: bool = True) -> int:
    """Q, K and V as the attention keeps them (RoPE's cos/sin table is the model's, read
    by every layer: not an activation).
    flash/SDPA (and the selective-recompute checkpoint) keep Q, K, V: views of the fused
    QKV output, which therefore stays whole, plus the rotated Q and K under RoPE, or Q's
    copy under GQA (reshaping Q out of the grouped layout copies it). `unfused` repeats
    K and V (counted with the kernel) and keeps Q itself only when its matmul needs no
    cast (fp32): the fused output if Q is a view of it, else Q's copy."""
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
    """What the attention kernel saves beyond Q, K and V: the part selective recompute
    drops. flash/SDPA: the fp32 log-sum-exp, and the output when the projection's input
    is a copy of it (else the output is counted as that input). unfused: the operands of
    its two matmuls, the s x s causal mask and the softmax probabilities (+ dropout)."""
    m = config.model
    if m.attention_backend != "unfused":
        out = x.a * x.s * x.b * x.q if x.device.attention_output_copied else 0
        return 4 * x.b * x.heads * x.s + out
    return _unfused_attention_bytes(config, x)


def _unfused_attention_bytes(config: Config, x: _Shapes) -> int:
    """attention_backends._unfused: K and V repeated to every head (copies), Q cast for
    the matmul under autocast, the [s, s] mask, the probabilities [b, heads, s, s] (fp32
    where autocast runs softmax in fp32), dropout's mask and output, and the matmul's
    copy of the probabilities when their dtype differs from V's."""
    p = config.model.attention_dropout
    bsq, probs = x.b * x.s * x.q, x.b * x.heads * x.s * x.s
    softmax = 4 if (not x.mixed or x.device.autocast_fp32_norm_softmax) else x.a
    total = 2 * x.a * bsq + x.s * x.s + softmax * probs  # K and V repeated, mask, softmax
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
    kernel_keeps_qkv = selective or config.model.attention_backend != "unfused"
    total = qkv_saved_bytes(config, x, kernel_keeps_qkv) + x.a * x.s * x.b * x.q
    if not selective:
        total += core_attention_bytes(config, x)
    return total + x.mask(config.model.hidden_dropout) * x.seq * x.b * x.h


def mlp_saved_bytes(config: Config, x: _Shapes) -> int:
    """GeLU: fc1's output and the GeLU output; SwiGLU: gate, silu(gate), up and their
    product; then the residual dropout's mask."""
    tensors = 4 if config.model.swiglu else 2
    return (tensors * x.a * x.s * x.b * x.f
            + x.mask(config.model.hidden_dropout) * x.seq * x.b * x.h)


def layer_saved_bytes(config: Config, x: _Shapes, contiguous: bool = True) -> int:
    """One transformer layer, without recompute or with selective recompute.
    `contiguous`: the residual stream is [s, b, h] in memory (SP, or a stage fed by the
    previous one) rather than the embedding's transposed [b, s, h]."""
    selective = getattr(config.model, "recompute_granularity", None) == "selective"
    return (2 * norm_saved_bytes(config, x)
            + norm_output_bytes(config, x, 1, contiguous)
            + attention_saved_bytes(config, x, selective)
            + norm_output_bytes(config, x, 1, contiguous)
            + mlp_saved_bytes(config, x))


def embedding_saved_bytes(config: Config, x: _Shapes) -> int:
    """Token ids (int64; under TP the shard-local ids and the out-of-shard mask) for the
    embedding's backward, position ids, and the embedding dropout's mask."""
    total = 8 * x.b * x.s + (x.b * x.s if x.tp > 1 else 0)
    if config.model.position_embedding_type == "learned_absolute":
        total += 8 * x.s
    return total + x.mask(config.model.hidden_dropout) * x.seq * x.b * x.h


def loss_saved_bytes(config: Config, x: _Shapes, contiguous: bool = True) -> int:
    """Final norm, the output layer's input, and the vocab-parallel cross-entropy's fp32
    softmax [s, b, V/t] with its target ids and out-of-shard mask."""
    return (norm_saved_bytes(config, x) + norm_output_bytes(config, x, 1, contiguous)
            + 4 * x.s * x.b * x.vocab + 8 * x.s * x.b + x.s * x.b)


# Activations: recompute, chunks, and the pipeline schedule.

def recompute_groups(config: Config, num_layers: int) -> list[tuple[int, bool]]:
    """(layers, recomputed) runs of one chunk, as the Decoder forms them: full uniform
    checkpoints groups of n layers; full block the first n layers one by one."""
    m = config.model
    granularity = getattr(m, "recompute_granularity", None)
    n = getattr(m, "recompute_num_layers", None) or 1
    if granularity != "full":
        return [(num_layers, False)] if num_layers else []
    if getattr(m, "recompute_method", None) == "uniform":
        return [(min(n, num_layers - i), True) for i in range(0, num_layers, n)]
    return [(1, i < n) for i in range(num_layers)]


@dataclass(frozen=True)
class ChunkActivations:
    """One micro-batch through one model chunk."""
    saved: int
    """Saved for backward, plus the chunk input and output the executor holds."""
    send_forward: int
    """Bytes of the output sent to the next stage (held until the step ends)."""
    send_backward: int
    """Bytes of the input gradient sent to the previous stage (held until the step ends)."""
    working_set: int
    """Recomputed in backward on top of `saved` (full recompute: one group)."""


def chunk_activations(config: Config, x: _Shapes, num_layers: int, pre: bool,
                      post: bool) -> ChunkActivations:
    contiguous = x.sp or not pre
    layer = layer_saved_bytes(config, x, contiguous)
    residual = x.a * x.seq * x.b * x.h
    saved, working = 0, 0
    for layers, recomputed in recompute_groups(config, num_layers):
        if recomputed:
            saved += residual  # the group's input, kept by the checkpoint
            working = max(working, layers * layer)
        else:
            saved += layers * layer
    if pre:
        saved += embedding_saved_bytes(config, x)
    else:
        saved += 0 if _first_layer_keeps_input(config, x) else residual  # received input
    if post:
        saved += loss_saved_bytes(config, x, contiguous)
    elif not contiguous:
        saved += residual  # the output [b, s, h] view; its contiguous copy is sent
    return ChunkActivations(saved, 0 if post else residual, 0 if pre else residual, working)


def _first_layer_keeps_input(config: Config, x: _Shapes) -> bool:
    """Whether the tensor received from the previous stage is itself saved by the first
    layer (so holding it costs nothing more): a checkpointed first group keeps it, a
    LayerNorm in the activation dtype keeps it, an fp32 RMSNorm keeps it (x.float() is
    x); a bf16/fp16 RMSNorm or a CUDA-autocast LayerNorm keep an fp32 copy instead."""
    groups = recompute_groups(config, 1)
    if groups and groups[0][1]:
        return True
    if config.model.normalization == "RMSNorm":
        return x.a == 4
    return not (x.mixed and x.device.autocast_fp32_norm_softmax)


def rank_chunks(config: Config, pp_rank: int, device: Device) -> list[ChunkActivations]:
    par = config.parallel
    p, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per_chunk = config.model.num_layers // (p * v)
    x = _shapes(config, device)
    return [chunk_activations(config, x, per_chunk, c * p + pp_rank == 0,
                              c * p + pp_rank == p * v - 1) for c in range(v)]


def activation_bytes(config: Config, pp_rank: int, device: Device) -> tuple[int, int, int]:
    """(one micro-batch through every chunk of this rank, the peak over the step, the p2p
    buffers held at that peak). The peak walks this rank's schedule (the same action list
    the executor runs): a forward adds its chunk's saved tensors and its send buffer, a
    backward first rebuilds a recomputed group (working set) and then frees the saved
    tensors and sends the input gradient, whose buffer stays until the step ends."""
    chunks = rank_chunks(config, pp_rank, device)
    par = config.parallel
    schedule = build_schedule(par.pipeline_model_parallel_size, pp_rank,
                              config.training.num_microbatches, len(chunks))
    piped = par.pipeline_model_parallel_size > 1
    live = sent = peak = peak_sent = 0
    for action in schedule:
        c = chunks[action.chunk]
        if action.kind == FORWARD:
            live += c.saved
            sent += c.send_forward if piped else 0
            now = live + sent
        else:
            now = live + sent + c.working_set
            live -= c.saved
            sent += c.send_backward if piped else 0
        if now > peak:
            peak, peak_sent = now, sent
    return sum(c.saved for c in chunks), peak, peak_sent


def microbatches_in_flight(pp_size: int, pp_rank: int, num_microbatches: int,
                           num_chunks: int = 1) -> int:
    """Most (micro-batch, chunk) forwards whose backward has not run yet on this rank."""
    live = peak = 0
    for action in build_schedule(pp_size, pp_rank, num_microbatches, num_chunks):
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak
