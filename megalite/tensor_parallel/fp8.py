"""FP8 matrix products for the tensor-parallel linear layers (Micikevicius et al. 2022,
"FP8 formats for deep learning"; docs/design.md "FP8").

Only the GEMM operands go to FP8: Y = X A^T quantizes X and A to e4m3, and the backward
quantizes dY (e5m2 under "hybrid", e4m3 under "e4m3") for dX = dY A and dA = dY^T X. Each
product runs in `torch._scaled_mm` with fp32 accumulation and returns the layer's dtype;
master weights, biases and everything outside the GEMMs stay as they are.

A quantized tensor is q = clamp(t / s, +-fp8_max) with s = amax / fp8_max, and the GEMM
multiplies the scales back in. Recipes:
- "tensorwise" (Megatron's name): one scale per tensor. The forward keeps the FP8 copies
  of X and A for the backward (half the bytes of bf16 copies), transposed as dA's and dX's
  GEMMs take them (scaled_mm).
- "rowwise" (torchao's rowwise scaling; megalite's own name in Megatron's flag): one scale
  per row of each operand along the contraction dimension, so each GEMM quantizes its own
  operands: the forward keeps X and A in their own dtype, as the plain linear layer does.

A scale is a function of the full logical tensor, never of a shard (docs/design.md §14): where an
operand's amax covers only this rank's shard it is all-reduced (max) over the TP group.
Column-parallel layers shard A's and dY's output dim, row-parallel ones A's and X's input
dim; the token dim is whole at every GEMM (sequence parallelism gathers before the
column-parallel GEMM and reduce-scatters after the row-parallel one). So TP n in FP8 is
one FP8 process within round-off.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.config import GPTConfig
from megalite.errors import ConfigError
from megalite.parallel_state import group_size
from megalite.tensor_parallel.weight_grad import LinearStep, apply_as_autocast_would, temporarily

FP8_FORMATS = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
               "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}
"""--fp8-format -> (dtype of X and A, dtype of dY)."""
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (torchao's EPS)


@dataclass(frozen=True)
class Fp8Recipe:
    """How one layer's GEMMs run in FP8: --fp8-format and --fp8-recipe."""
    format: str
    recipe: str

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(dtype of X and A, dtype of dY)"""
        return FP8_FORMATS[self.format]


def layer_fp8_recipe(config: GPTConfig, layer_number: int) -> Fp8Recipe | None:
    """The recipe of transformer layer `layer_number` (global, from 0), or None where it
    stays in high precision: without --fp8-format, and in the first and last layers under
    --first-last-layers-bf16 (Megatron's --num-layers-at-start/end-in-bf16)."""
    if config.fp8_format is None:
        return None
    if config.first_last_layers_bf16 and not (
            config.num_layers_at_start_in_bf16 <= layer_number
            < config.num_layers - config.num_layers_at_end_in_bf16):
        return None
    return Fp8Recipe(config.fp8_format, config.fp8_recipe)


@dataclass(frozen=True)
class Quantized:
    """q = t / scale in FP8; `scale` is a 0-dim fp32 tensor, or per row (M, 1) of an
    [M, K] operand / per column (1, N) of a [K, N] one, as torch._scaled_mm takes them."""
    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> "Quantized":
        return Quantized(self.data.t(), _transposed_scale(self.scale))


def _transposed_scale(scale: torch.Tensor) -> torch.Tensor:
    # A row of scales as a contiguous column and back (a 0-dim one as it is): a plain
    # .t() would leave the stride torch._scaled_mm refuses for a scale of [M, 1].
    return scale.reshape(scale.shape[::-1])


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None,
             group=None) -> Quantized:
    """t in FP8 `dtype`, scaled by its amax (over `dim`, kept, or the whole tensor), the
    amax all-reduced (max) over `group` when t is a shard of the tensor to scale. The
    codes keep t's layout."""
    t = t.detach()  # no graph to record (and one compiled variant, not one per requires_grad)
    return Quantized(*_kernel(_scale_and_cast, t)(t, _group_amax(t, dim, group), dtype))


def quantize_transposed(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None,
                        group=None) -> Quantized:
    """quantize(t, ...).t() with its codes written row-major in the same pass: the operand
    of a GEMM that contracts t's first dim (see scaled_mm), without a transposing copy."""
    t = t.detach()
    return Quantized(*_kernel(_scale_and_cast_t, t)(t, _group_amax(t, dim, group), dtype))


def quantize_both(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None,
                  group=None) -> tuple[Quantized, Quantized]:
    """(quantize(t, ...), quantize_transposed(t, ...)) from one amax and one pass over t
    (Transformer Engine's cast-transpose): t is an operand of two GEMMs, contracted along
    its second dim in one and its first in the other."""
    t = t.detach()
    data, data_t, scale = _kernel(_scale_and_cast_both, t)(t, _group_amax(t, dim, group), dtype)
    return Quantized(data, scale), Quantized(data_t, _transposed_scale(scale))


def _group_amax(t: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    amax = _kernel(_amax, t)(t, dim)
    if group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _amax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    return (t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)).float()


def _scaled(t: torch.Tensor, amax: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale clamped to the FP8 range, in fp32, scale)."""
    # fp8_max from the dtype here, not an argument: compiled with dynamic shapes, a float
    # argument becomes a graph input read back with .item() at every call (seen on an H100).
    fp8_max = torch.finfo(dtype).max
    scale = amax.clamp(min=_AMAX_FLOOR) / fp8_max
    return (t.float() / scale).clamp(-fp8_max, fp8_max), scale


def _scale_and_cast(t: torch.Tensor, amax: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, scale = _scaled(t, amax, dtype)
    return scaled.to(dtype), scale


def _scale_and_cast_t(t: torch.Tensor, amax: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, scale = _scaled(t, amax, dtype)
    return _cast_row_major(scaled.t(), dtype), _transposed_scale(scale)


def _scale_and_cast_both(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scaled, scale = _scaled(t, amax, dtype)
    return scaled.to(dtype), _cast_row_major(scaled.t(), dtype), scale


def _cast_row_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The transpose happens in the cast (one op reading t strided), never as a copy of the
    # FP8 codes; per element the same cast as .to(dtype), so the codes are bit-equal.
    return t.to(dtype, memory_format=torch.contiguous_format)


def quantize_weights_once(step: LinearStep):
    """Inside (one training step's forwards and backwards), a tensorwise FP8 layer running
    with `step` (its model's, weight_grad.LinearStep, where the copies are kept) quantizes
    its weight at its first micro-batch and reuses that copy in the others and in a
    recomputed forward, as Transformer Engine keeps its FP8 weights over micro-batches: the
    weights change only at the optimizer step, after this ends. The same copy the uncached
    layer would make (same weight, same amax), so the same results. A weight's amax pass and
    cast move 5 bytes an element, about a tenth of the time of its three FP8 GEMMs at 4096
    tokens a micro-batch: now once a step instead of once a micro-batch.
    The copies live until the context ends: one per layer, not one per micro-batch in
    flight. Both layouts are kept, A row-major for the forward and A^T row-major for dX
    (cuBLASLt takes each FP8 operand only with its contraction dim contiguous, see
    scaled_mm): two bytes an element, a bf16 weight's size, as Transformer Engine keeps an
    FP8 weight and its transpose. Keeping one and transposing it for the other GEMM would
    be a copy per micro-batch again, the cost this removes."""
    return temporarily(step, "fp8_weights", {})


def _quantized_weight(weight: torch.Tensor, dtype: torch.dtype, group,
                      step: LinearStep) -> tuple[Quantized, Quantized]:
    """(A, A^T) in FP8, each written row-major: the forward's and dX's GEMM operands."""
    # Traced, each micro-batch casts again (fused by inductor): a dict read here would be
    # guarded on and recompile the layer every step.
    if torch.compiler.is_compiling() or step.fp8_weights is None:
        return quantize_both(weight, dtype, None, group)
    key = (id(weight), dtype)
    if key not in step.fp8_weights:  # the weight is kept with it, so its id is not reused
        step.fp8_weights[key] = (weight, quantize_both(weight, dtype, None, group))
    return step.fp8_weights[key][1]


def _kernel(fn, t: torch.Tensor):
    """fn compiled for a CUDA tensor, else fn itself. Eagerly, every op of a quantization
    is a pass over the tensor with an fp32 intermediate (abs, amax, float, divide, clamp,
    cast): about 37 bytes an element, more time for a weight than its FP8 GEMMs save.
    Compiled, the amax is one reduction and the rest one pass that reads t and writes one
    byte an element, with the same arithmetic. On a CPU, inductor's C++ build would take
    minutes on a small machine. Inside a compiled layer fn is traced into the layer's own
    graph."""
    return _compiled(fn) if t.is_cuda and not torch.compiler.is_compiling() else fn


@functools.cache
def _compiled(fn):
    # dynamic: one kernel for every layer's shapes instead of a recompile for each.
    return torch.compile(fn, dynamic=True)


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N] in FP8 with fp32 accumulation. cuBLASLt's FP8 GEMM takes only
    the "TN" layout, each operand with its contraction dim K contiguous: a row-major, b
    column-major, every dim a multiple of 16. The FP8 layers pass them so (quantize_transposed
    writes the transposed codes in the quantization's own pass); another layout is copied
    here, one transposing copy per GEMM (on an H100 such copies were the largest kernels
    after the GEMMs, docs/benchmarks.md). `fast_accum`: Hopper's FP8 tensor cores
    accumulate in fewer bits unless the sum is promoted to fp32 now and then, which costs
    time; torchao (and Transformer Engine) take the fast path for the forward GEMM only and
    promote in the gradients' GEMMs, where small contributions add up. A CPU ignores it."""
    if a.data.is_cuda:
        if not torch.compiler.is_compiling():  # traced: checked when the model was built
            check_fp8_device(a.data.device)
        _check_dims(a.data.shape, b.data.shape)
    # On CUDA, rowwise scaling writes bf16 only; the cast back is the one extra rounding.
    gemm_dtype = (torch.bfloat16 if a.data.is_cuda and a.scale.dim() else out_dtype)
    # Both no-ops (no copy) for operands already in cuBLASLt's layouts.
    # gpu_check: fp8_paths
    out = torch._scaled_mm(a.data.contiguous(), b.data.t().contiguous().t(),
                           scale_a=a.scale, scale_b=b.scale, out_dtype=gemm_dtype,
                           use_fast_accum=fast_accum)
    return out.to(out_dtype)


def check_fp8_device(device: torch.device):
    """Refuses a CUDA GPU without FP8 tensor cores, by name."""
    major, minor = _capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"--fp8-format needs FP8 tensor cores (compute capability >= 8.9: "
                          f"Ada, Hopper, Blackwell); GPU {device} has {major}.{minor}")


def _check_dims(a_shape, b_shape):
    if any(d % 16 for d in (*a_shape, b_shape[1])):
        raise ConfigError(f"--fp8-format: an FP8 GEMM of [{a_shape[0]}, {a_shape[1]}] x "
                          f"[{b_shape[0]}, {b_shape[1]}] has a dim that is not a multiple of "
                          f"16, as FP8 tensor cores need: make micro-batch x sequence length, "
                          f"the hidden size and the per-TP-rank QKV and MLP widths multiples "
                          f"of 16")


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)  # gpu_check: fp8_paths


class _Fp8Linear(torch.autograd.Function):
    """Y = X A^T + b with FP8 GEMMs. `row_parallel`: X and A hold this rank's block of the
    input dim (a row-parallel layer), else A and dY that of the output dim."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, group, row_parallel: bool,
                step: LinearStep):
        x2d = x.reshape(-1, x.shape[-1])
        ctx.recipe, ctx.group, ctx.row_parallel, ctx.step = recipe, group, row_parallel, step
        fwd_dtype = recipe.dtypes[0]
        x_group = group if row_parallel else None
        if recipe.rowwise:  # scales along the input dim K: sharded in a row-parallel layer
            xq = quantize(x2d, fwd_dtype, 1, x_group)
            wq = quantize(weight, fwd_dtype, 1, x_group).t()  # A row-major: A^T column-major
            ctx.save_for_backward(weight, x2d)
        else:
            # X^T and A^T row-major, written with X and A, for dA = dY^T X and dX = dY A
            xq, xq_t = quantize_both(x2d, fwd_dtype, None, x_group)
            wq, wq_t = _quantized_weight(weight, fwd_dtype, group, step)
            wq = wq.t()
            # weight itself only for a deferred weight gradient to land on
            ctx.save_for_backward(weight, xq_t.data, xq_t.scale, wq_t.data, wq_t.scale)
        y = scaled_mm(xq, wq, x.dtype, fast_accum=True)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        recipe, group = ctx.recipe, ctx.group
        fwd_dtype, grad_dtype = recipe.dtypes
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        out_group = None if ctx.row_parallel else group  # dY's output dim sharded
        # Operands in cuBLASLt's layouts (scaled_mm): gq and gq_t row-major, wq ([N, K])
        # and xq ([M, K]) column-major, i.e. the transposes of row-major A^T and X^T.
        if recipe.rowwise:
            weight, x2d = ctx.saved_tensors
            # dX = dY A contracts the output dim N, dA = dY^T X the token dim (never sharded).
            gq = quantize(g2d, grad_dtype, 1, out_group)
            wq = quantize_transposed(weight, fwd_dtype, 0, out_group).t()
            gq_t = quantize_transposed(g2d, grad_dtype, 0)
            xq = quantize_transposed(x2d, fwd_dtype, 0).t()
            dtype = x2d.dtype
        else:
            weight, xd_t, xs, wd_t, ws = ctx.saved_tensors
            xq, wq = Quantized(xd_t, xs).t(), Quantized(wd_t, ws).t()
            gq, gq_t = quantize_both(g2d, grad_dtype, None, out_group)
            dtype = grad_output.dtype
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(gq, wq, dtype).reshape(*grad_output.shape[:-1], wq.data.shape[1])
        if ctx.needs_input_grad[2]:  # False for a bias of None
            grad_bias = g2d.sum(0)
        if ctx.needs_input_grad[1]:
            grad_weight = ctx.step.weight_grad_now_or_deferred(
                weight, functools.partial(_wgrad, dtype=dtype), gq_t.data, gq_t.scale,
                xq.data, xq.scale)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def _wgrad(g_data, g_scale, x_data, x_scale, *, dtype):
    """dA = dY^T X from their FP8 copies (the deferred W pass of a zero-bubble schedule
    runs this too)."""
    return scaled_mm(Quantized(g_data, g_scale), Quantized(x_data, x_scale), dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               recipe: Fp8Recipe, group, step: LinearStep, *,
               row_parallel: bool) -> torch.Tensor:
    """weight_grad.linear with FP8 GEMMs (its weight gradient deferrable the same way, its
    weight's FP8 copies kept by `step` under quantize_weights_once).
    Inside a compiled layer at TP 1 it is traced into the layer's graph, so inductor fuses
    each quantization with the ops around it. Run eagerly between the compiled graphs, as
    first built, it cost an H100 1.2 ms of host time per FP8 linear and direction (graph
    breaks, guards, the compiled quantizations' calls) and left the GPU idle 28% of an FP8
    step (docs/benchmarks.md). Over a TP group it stays eager: its amax all-reduce is not
    traced."""
    apply = (apply_as_autocast_would if torch.compiler.is_compiling() and group_size(group) == 1
             else _eager_apply_as_autocast_would)
    return apply(_Fp8Linear.apply, x, weight, bias, recipe, group, row_parallel, step)


_eager_apply_as_autocast_would = torch.compiler.disable(apply_as_autocast_would)
