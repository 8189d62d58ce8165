"""Cross-entropy over a vocabulary split across the tensor-parallel group (Megatron-LM §3).

Each rank holds logits for its block of the vocabulary, [..., V / tp]. The loss
    loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v
needs three reductions over the vocabulary, each an all-reduce of one number per token
(max, target logit, sum of exponentials), never an all-gather of the [..., V] logits.
The gradient on each shard is (softmax - onehot(target)) restricted to the shard.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel_state import group_rank
from megalite.tensor_parallel.mappings import all_reduce_


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's memory-lean form: one fp32 [..., V / tp] buffer holds the logits, then
    the shifted logits, their exponentials and the softmax (all in place), is saved for
    backward and becomes the gradient there, again in place."""

    @staticmethod
    def forward(ctx, logits, target, group):
        shard_size = logits.shape[-1]
        vocab_start = group_rank(group) * shard_size
        ctx.logits_dtype = logits.dtype
        buffer = logits.float()  # the caller's fp32 logits themselves: overwritten

        logits_max = all_reduce_(buffer.max(dim=-1).values, group, dist.ReduceOp.MAX)
        buffer.sub_(logits_max.unsqueeze(-1))

        # The target logit lives on exactly one rank; the others contribute 0.
        elsewhere = (target < vocab_start) | (target >= vocab_start + shard_size)
        local_target = (target - vocab_start).masked_fill(elsewhere, 0)
        target_logit = buffer.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = all_reduce_(target_logit.masked_fill(elsewhere, 0.0), group)

        sum_exp = all_reduce_(buffer.exp_().sum(dim=-1), group)
        loss = sum_exp.log() - target_logit

        softmax = buffer.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, elsewhere, local_target)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        # The saved softmax becomes the gradient in place: backward runs once per forward.
        grad, elsewhere, local_target = ctx.saved_tensors
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          -(~elsewhere).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss [...] from this rank's vocabulary shard of the logits [..., V / tp]
    (computed in fp32) and global target ids [...] in [0, V). Equals
    F.cross_entropy(full_logits, target, reduction='none'); masking is the caller's job.
    fp32 `logits` are overwritten (with the softmax, then the gradient): pass a tensor
    that nothing else reads, as the model's fresh fp32 logits are."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)


def whole_vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss [...] (fp32) from the whole vocabulary's logits [..., V] in their own
    dtype, `mask` (True: vocabulary padding) filled with -inf first. Written for
    torch.compile (one process holds the whole vocabulary): traced, inductor reads the logits
    in their dtype, computes in fp32 registers, saves the logits, the target ids and two
    fp32 numbers a token (max, log-sum-exp), and the backward writes the gradient in one
    pass. The eager vocab-parallel form
    passes over an fp32 [tokens, V] buffer about ten times (on an H100 about 20 ms of a
    474 ms 1.1B step: docs/design.md §23)."""
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    losses = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none")
    return losses.view(target.shape)
