"""The routed experts' matrix products: rows of `x` grouped by expert (the dispatcher's
layout), each block times its own expert's weight.

`grouped_linear` runs them either as one grouped GEMM (torch._grouped_mm, which torch 2.13
runs on CPUs in fp32, bf16 and fp16 when every operand's rows are 16-byte aligned) or as a
loop over the experts, the reference it must equal. torch's own autograd formula for
_grouped_mm hands the backward a broadcast (stride 0) gradient that the CPU kernel refuses,
so the backward here calls the kernel itself on contiguous operands. Experts without tokens
get what the loop gives them whatever the kernel writes for an empty group (_GroupedLinear).
"""

import torch


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   grouped: bool) -> torch.Tensor:
    """x [N, in] (expert e's rows contiguous, tokens_per_expert[e] of them, in expert order),
    weight [E, out, in] -> [N, out]: each row times its expert's weight transposed."""
    if grouped:
        return _GroupedLinear.apply(x, weight, tokens_per_expert)
    blocks = x.split(tokens_per_expert.tolist())
    return torch.cat([block @ w.t() for block, w in zip(blocks, weight)])


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
