"""The routed experts' matrix products: rows of `x` grouped by expert (the dispatcher's
layout), each block times its own expert's weight.

`grouped_linear` runs them either as one grouped GEMM (torch._grouped_mm, which torch 2.13
runs on CPUs in fp32, bf16 and fp16 when every operand's rows are 16-byte aligned; on GPUs
`grouped_mm_path` says where it is one kernel) or as a loop over the experts, the reference
it must equal. torch's own autograd formula for
_grouped_mm hands the backward a broadcast (stride 0) gradient that the CPU kernel refuses,
so the backward here calls the kernel itself on contiguous operands. Experts without tokens
get what the loop gives them whatever the kernel writes for an empty group (_GroupedLinear).
"""

import re

import torch

from megalite.errors import ConfigError

KERNEL, LOOP = "kernel", "loop"


def grouped_mm_path(torch_version: str, capability: tuple[int, int] | None,
                    dtype: torch.dtype) -> str | None:
    """What torch._grouped_mm runs, by torch release, device (`capability`: an NVIDIA GPU's
    compute capability; None for the CPU and every other device) and dtype, as aten's
    _grouped_mm_cuda decides it (its _scaled_mm_allowed_device(sm90_only, sm100_only) gate):
    - KERNEL: CUTLASS's grouped GEMM, one launch, no host sync: bf16 on sm_90 (torch 2.8),
      on sm_90 or sm_100 (torch 2.9 on);
    - LOOP: torch's fallback, one GEMM per expert after copying the offsets to the host (on
      a GPU a sync every call, as megalite's own loop without --moe-grouped-gemm): every
      other device and dtype from torch 2.9 (the CPU's only path);
    - None: torch raises: before 2.8 (no _grouped_mm), and in 2.8 for all but bf16 on sm_90.
    Not modelled: cuBLASLt's grouped GEMM, which torch built with CUDA 13.3 or later may take
    for fp16 (pytorch#177037); there the note over-warns."""
    release = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    if release < (2, 8):
        return None
    archs = (9,) if release < (2, 9) else (9, 10)
    if capability is not None and capability[0] in archs and dtype == torch.bfloat16:
        return KERNEL
    return LOOP if release >= (2, 9) else None


def check_grouped_gemm_device(device: torch.device, dtype: torch.dtype) -> str | None:
    """--moe-grouped-gemm on `device` in `dtype` with this torch: a ConfigError where
    torch._grouped_mm would raise; a note to print where a GPU would run torch's loop over
    the experts instead of a grouped kernel (no faster than without the flag); else None."""
    capability = None
    if device.type == "cuda" and torch.version.hip is None:  # gpu_check: moe_paths
        capability = torch.cuda.get_device_capability(device)
    where = (f"torch {torch.__version__} on {device.type}"
             f"{f' sm_{capability[0]}{capability[1]}' if capability else ''} in {dtype}")
    path = grouped_mm_path(torch.__version__, capability, dtype)
    if path is None:
        raise ConfigError(f"--moe-grouped-gemm: torch._grouped_mm cannot run {where} (torch "
                          "2.8 has only its bf16 kernel for sm_90 GPUs; torch 2.9 and later "
                          "run every device and dtype): upgrade torch or drop the flag")
    if path == LOOP and device.type != "cpu":
        return (f"> --moe-grouped-gemm: {where} has no grouped kernel (bf16 on sm_90 or "
                "sm_100 has one): torch runs one GEMM per expert after a host sync, as "
                "megalite does without the flag")
    return None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   grouped: bool) -> torch.Tensor:
    """x [N, in] (expert e's rows contiguous, tokens_per_expert[e] of them, in expert order),
    weight [E, out, in] -> [N, out]: each row times its expert's weight transposed."""
    if grouped:
        return _GroupedLinear.apply(x, weight, tokens_per_expert)
    blocks = x.split(tokens_per_expert.tolist())
    return torch.cat([block @ w.t() for block, w in zip(blocks, weight)])


# gpu_check: moe_paths
class _GroupedLinear(torch.autograd.Function):
    """Nothing here depends on what the kernel writes for an expert without rows (B200's
    kernel writes nothing, pytorch#172439): a weight gradient's empty groups are zeroed, and
    with no rows at all (no expert of this rank got a token) the kernel is not called."""

    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert):
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        ctx.save_for_backward(x, weight, offsets, tokens_per_expert)
        if x.shape[0] == 0:
            return x.new_empty(0, weight.shape[1])
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets, tokens_per_expert = ctx.saved_tensors
        if x.shape[0] == 0:
            return torch.zeros_like(x), torch.zeros_like(weight), None
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offsets)           # [N, in]
        if ctx.needs_input_grad[1]:
            # Per expert grad^T x over its rows; an expert without rows gets zeros.
            grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)           # [E, out, in]
            grad_w.masked_fill_((tokens_per_expert == 0)[:, None, None], 0)
        return grad_x, grad_w, None
