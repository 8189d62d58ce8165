"""The routed experts' matrix products: rows of `x` grouped by expert (the dispatcher's
layout), each block times its own expert's weight.

`grouped_linear` runs them either as one grouped GEMM (torch._grouped_mm, which torch 2.13
runs on CPUs in fp32, bf16 and fp16 when every operand's rows are 16-byte aligned) or as a
loop over the experts, the reference it must equal. torch's own autograd formula for
_grouped_mm hands the backward a broadcast (stride 0) gradient that the CPU kernel refuses,
so the backward here calls the kernel itself on contiguous operands.
"""

import torch


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   grouped: bool) -> torch.Tensor:
    """x [N, in] (expert e's rows contiguous, tokens_per_expert[e] of them, in expert order),
    weight [E, out, in] -> [N, out]: each row times its expert's weight transposed."""
    if grouped:
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        return _GroupedLinear.apply(x, weight, offsets)
    blocks = x.split(tokens_per_expert.tolist())
    return torch.cat([block @ w.t() for block, w in zip(blocks, weight)])


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offsets)           # [N, in]
        if ctx.needs_input_grad[1]:
            # Per expert grad^T x over its rows; an expert without rows gets zeros.
            grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)           # [E, out, in]
        return grad_x, grad_w, None
