"""ZeRO-1 bookkeeping: optimizer memory per rank against the closed form, and an fp16
overflow on one rank making every rank skip."""

import pytest
import torch

from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.grad_scaler import DynamicGradScaler
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed

from tests.helpers import tiny_gpt_config

pytestmark = pytest.mark.slow  # every test here launches processes

CONFIG = tiny_gpt_config(padded_vocab_size=61)


def model_and_optimizer(state, scaler=None):
    model = GPTModel(CONFIG, seed=1)
    dp_group = state.dp_group if state else None
    # One bucket for the model, and one of its own for the (tied) word embeddings, so
    # the closed form of the shards is simple.
    grad_buffer = GradBuffer(list(model.parameters()), dp_group, 10 ** 9, shard=True)
    optimizer = MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-3), scaler, None, None,
                                        grad_buffer)
    return model, optimizer


def backward(model, optimizer, tokens):
    optimizer.grad_buffer.start_step(1)
    optimizer.scale_loss(model(tokens, tokens).mean()).backward()


def one_step(model, optimizer):
    tokens = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    backward(model, optimizer, tokens)
    optimizer.grad_buffer.finish()
    return optimizer.step()


def optimizer_bytes(rank, world_size):
    state = ParallelState(RankGrid(world_size), rank)
    model, optimizer = model_and_optimizer(state)
    one_step(model, optimizer)
    return optimizer.optimizer_state_bytes(), bucket_sizes(model)


def bucket_sizes(model) -> list[int]:
    embedding = model.embedding.word_embeddings.weight.numel()
    return [sum(p.numel() for p in model.parameters()) - embedding, embedding]


def expected_share(bucket_numel: int, dp: int, rank: int) -> int:
    """A bucket padded to a multiple of DP and cut in DP equal shards: rank r owns the
    real (unpadded) elements of shard r."""
    shard = -(-bucket_numel // dp)
    return max(0, min(shard, bucket_numel - rank * shard))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_optimizer_state_is_12_bytes_per_owned_parameter(dp):
    """fp32 main copy (4 B) + Adam's two moments (8 B) for this rank's share, nothing more."""
    if dp == 1:
        results = [optimizer_bytes_single()]
    else:
        results = run_distributed(dp, optimizer_bytes)
    sizes = results[0][1]
    for rank, (nbytes, _) in enumerate(results):
        assert nbytes == 12 * sum(expected_share(n, dp, rank) for n in sizes)
    # Every element is owned by exactly one rank: the shares add up to the model.
    assert sum(nbytes for nbytes, _ in results) == 12 * sum(sizes)
    assert max(nbytes for nbytes, _ in results) <= 12 * sum(n // dp + 1 for n in sizes)


def optimizer_bytes_single():
    model, optimizer = model_and_optimizer(None)
    one_step(model, optimizer)
    return optimizer.optimizer_state_bytes(), bucket_sizes(model)


def overflow_on_rank_zero(rank, world_size):
    state = ParallelState(RankGrid(world_size), rank)
    scaler = DynamicGradScaler(2.0 ** 10, 1.0, window=1000, hysteresis=1)
    model, optimizer = model_and_optimizer(state, scaler)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 61, (2, 8))
    backward(model, optimizer, tokens)
    if rank == 0:
        # An inf in a gradient element that rank 1's shard holds after the reduce-scatter.
        list(model.parameters())[-1].grad.view(-1)[-1] = float("inf")
    optimizer.grad_buffer.finish()
    updated, norm = optimizer.step()
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return updated, norm, scaler.scale, unchanged


def test_fp16_overflow_on_one_rank_skips_everywhere():
    results = run_distributed(2, overflow_on_rank_zero)
    assert results == [(False, None, 2.0 ** 9, True)] * 2
