"""Gradient accumulation in the data-parallel buffer against micro-batch gradients taken
one by one: with --accumulate-allreduce-grads-in-fp32 the buffer holds their fp32 sum
exactly; without it, their bf16 sum, rounded after every addition as autograd does."""

import torch

from megalite.distributed.grad_buffer import GradBuffer, bucket_layout, padded_size
from megalite.model.gpt import GPTModel

from tests.helpers import tiny_gpt_config

CONFIG = tiny_gpt_config(attention_backend="unfused")
NUM_MICRO = 4


def bf16_model():
    return GPTModel(CONFIG, seed=3).to(torch.bfloat16)


def microbatches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(NUM_MICRO)]


def backward(model, tokens):
    model(tokens, tokens).float().mean().backward()


def separate_grads(model):
    """Each micro-batch's bf16 gradient on its own, name -> list."""
    grads = {}
    for tokens in microbatches():
        model.zero_grad(set_to_none=True)
        backward(model, tokens)
        for name, p in model.named_parameters():
            grads.setdefault(name, []).append(p.grad.clone())
    return grads


def buffered_grads(model, grad_dtype):
    buffer = GradBuffer(list(model.parameters()), None, 5000, grad_dtype=grad_dtype)
    buffer.start_step(NUM_MICRO)
    for tokens in microbatches():
        backward(model, tokens)
    buffer.finish()
    return {name: p.main_grad for name, p in model.named_parameters()}


def sequential_sum(tensors, dtype):
    total = torch.zeros_like(tensors[0], dtype=dtype)
    for t in tensors:
        total += t.to(dtype)
    return total


def test_fp32_accumulation_is_the_exact_fp32_sum_of_microbatch_grads():
    reference = separate_grads(bf16_model())
    model = bf16_model()
    buffered = buffered_grads(model, torch.float32)
    for name, grad in buffered.items():
        assert grad.dtype == torch.float32
        assert torch.equal(grad, sequential_sum(reference[name], torch.float32)), name
    # The bf16 per-micro-batch gradients were folded in and dropped, not kept around.
    assert all(p.grad is None for p in model.parameters())


def test_bf16_accumulation_rounds_after_every_microbatch():
    reference = separate_grads(bf16_model())
    buffered = buffered_grads(bf16_model(), None)
    rounded = 0
    for name, grad in buffered.items():
        assert grad.dtype == torch.bfloat16
        assert torch.equal(grad, sequential_sum(reference[name], torch.bfloat16)), name
        exact = sequential_sum(reference[name], torch.float32)
        rounded += int(not torch.equal(grad.float(), exact))
    # So the fp32 buffer is not a no-op: most gradients lose digits in bf16.
    assert rounded > len(buffered) // 2


def test_bucket_layout_cuts_runs_of_one_dtype_and_isolates_shared_embeddings():
    """Worked by hand, bucket size 8: 3 + 5 fill a bucket, a dtype change or overflow
    starts the next, a 9-element tensor sits alone, the shared embedding comes last."""
    f32, bf16 = torch.float32, torch.bfloat16
    numels = [4, 3, 5, 2, 9, 1, 6]
    dtypes = [f32, f32, f32, bf16, bf16, bf16, f32]
    shared = [True] + [False] * 6
    assert bucket_layout(numels, dtypes, shared, 8) == [[1, 2], [3], [4], [5], [6], [0]]
    assert [padded_size(n, 4) for n in (7, 8, 9)] == [8, 8, 12]


def test_bucket_layout_puts_experts_in_buckets_of_their_own():
    """Expert parameters are reduced over another group (expert-DP): after the dense
    buckets, in runs of their own, never sharing a bucket with a dense parameter."""
    numels, dtypes = [2, 3, 2, 3, 2, 1], [torch.float32] * 6
    shared = [True, False, False, False, False, False]
    expert = [False, False, True, False, True, False]
    assert bucket_layout(numels, dtypes, shared, 8, expert) == [[1, 3, 5], [2, 4], [0]]
    assert bucket_layout(numels, dtypes, shared, 3, expert) == [[1], [3], [5], [2], [4], [0]]
