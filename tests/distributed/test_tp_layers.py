"""Tensor-parallel operators and layers against closed forms and unsharded references.

One spawn per TP size runs every check: each mapping's forward and backward against its
formula; ColumnParallel/RowParallel/VocabParallelEmbedding against nn.Linear/nn.Embedding
(shards cut from the reference weights, sharded grads gathered back); the vocab-parallel
cross-entropy against F.cross_entropy; the dropout RNG tracker, and attention's fork of it.
fp32 throughout.
Every rank builds the same full tensors from seeded generators, so nothing is broadcast.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.errors import ConfigError
from megalite.model.attention import SelfAttention
from megalite.spawn import run_distributed
from megalite.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    allreduce_sequence_parallel_grads, build_rng_tracker,
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, model_parallel_seed,
    reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy)

from tests.helpers import tiny_gpt_config

pytestmark = pytest.mark.slow  # every test here launches processes


S, B, H, OUT, VOCAB = 8, 2, 8, 12, 16      # seq, batch, hidden, output, vocab: divisible by 4


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (plain dist.all_gather, not the code under test)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    return full.chunk(tp, dim=dim)[rank].contiguous()


def forward_backward(op, x, grad_out):
    """op(x) and d<op(x), grad_out>/dx."""
    x = x.clone().requires_grad_()
    y = op(x)
    y.backward(grad_out)
    return y.detach(), x.grad


# ---------------------------------------------------------------- mappings (closed forms)

def check_mappings(rank, tp, group):
    # Inputs and upstream grads differ per rank (seed + rank); every rank can build all of them.
    xs = [randn(S, B, H, seed=100 + r) for r in range(tp)]
    gs = [randn(S, B, H, seed=200 + r) for r in range(tp)]
    x, g = xs[rank], gs[rank]

    y, dx = forward_backward(lambda t: copy_to_tensor_model_parallel_region(t, group), x, g)
    close(y, x, "copy_to fwd")
    close(dx, sum(gs), "copy_to bwd = all-reduce")

    y, dx = forward_backward(lambda t: reduce_from_tensor_model_parallel_region(t, group), x, g)
    close(y, sum(xs), "reduce_from fwd = all-reduce")
    close(dx, g, "reduce_from bwd")

    gs_shard = [shard(t, -1, r, tp) for r, t in enumerate(gs)]
    y, dx = forward_backward(lambda t: scatter_to_tensor_model_parallel_region(t, group),
                             x, gs_shard[rank])
    close(y, shard(x, -1, rank, tp), "scatter_to_tp fwd")
    close(dx, torch.cat(gs_shard, dim=-1), "scatter_to_tp bwd = all-gather last dim")

    xs_shard = [shard(t, -1, r, tp) for r, t in enumerate(xs)]
    y, dx = forward_backward(lambda t: gather_from_tensor_model_parallel_region(t, group),
                             xs_shard[rank], g)
    close(y, torch.cat(xs_shard, dim=-1), "gather_from_tp fwd = all-gather last dim")
    close(dx, shard(g, -1, rank, tp), "gather_from_tp bwd")

    gs_seq = [shard(t, 0, r, tp) for r, t in enumerate(gs)]
    y, dx = forward_backward(lambda t: scatter_to_sequence_parallel_region(t, group),
                             x, gs_seq[rank])
    close(y, shard(x, 0, rank, tp), "scatter_to_sp fwd")
    close(dx, torch.cat(gs_seq, dim=0), "scatter_to_sp bwd = all-gather dim 0")

    xs_seq = [shard(t, 0, r, tp) for r, t in enumerate(xs)]
    y, dx = forward_backward(lambda t: gather_from_sequence_parallel_region(t, group),
                             xs_seq[rank], g)
    close(y, torch.cat(xs_seq, dim=0), "gather_from_sp fwd = all-gather dim 0")
    close(dx, shard(sum(gs), 0, rank, tp), "gather_from_sp bwd = reduce-scatter dim 0")
    y, dx = forward_backward(
        lambda t: gather_from_sequence_parallel_region(t, group, tensor_parallel_output_grad=False),
        xs_seq[rank], g)
    close(dx, shard(g, 0, rank, tp), "gather_from_sp(tensor_parallel_output_grad=False) bwd")

    y, dx = forward_backward(lambda t: reduce_scatter_to_sequence_parallel_region(t, group),
                             x, gs_seq[rank])
    close(y, shard(sum(xs), 0, rank, tp), "reduce_scatter_to_sp fwd")
    close(dx, torch.cat(gs_seq, dim=0), "reduce_scatter_to_sp bwd = all-gather dim 0")

    # A dim not divisible by the group size is refused before any collective is started.
    odd = torch.zeros(tp + 1, B, tp + 1)
    for op, dim in [(scatter_to_tensor_model_parallel_region, -1),
                    (scatter_to_sequence_parallel_region, 0),
                    (reduce_scatter_to_sequence_parallel_region, 0)]:
        with pytest.raises(ConfigError, match=f"dim {dim} .* size {tp + 1}, not divisible by "
                                              f"the tensor-parallel size {tp}"):
            op(odd, group)


def check_size_one_groups_are_identity(rank, tp):
    # Every rank creates every group (new_group is collective), then uses its own.
    singles = [dist.new_group([r]) for r in range(tp)]
    x = randn(S, B, H, seed=300 + rank)
    for group in (None, singles[rank]):
        for op in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                   scatter_to_tensor_model_parallel_region,
                   gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region,
                   gather_from_sequence_parallel_region,
                   reduce_scatter_to_sequence_parallel_region):
            y, dx = forward_backward(lambda t: op(t, group), x, 2 * x)
            close(y, x, f"{op.__name__} fwd at size 1")
            close(dx, 2 * x, f"{op.__name__} bwd at size 1")


# ---------------------------------------------------------------- layers vs unsharded references

def load_shards(layer: nn.Module, reference: nn.Module, rank: int, tp: int):
    """Initialise the sharded layer from the full reference tensors, as the model does."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            full = getattr(reference, name)
            if param.tensor_model_parallel:
                full = full.chunk(tp, dim=param.partition_dim)[rank]
            param.copy_(full)


def check_grads_equal(layer, reference, group, what):
    for name, param in layer.named_parameters():
        grad = param.grad
        if param.tensor_model_parallel:
            grad = gather(grad, param.partition_dim, group)
        close(grad, getattr(reference, name).grad, f"{what}: grad of {name}")


def reference_linear(in_size, out_size, seed):
    torch.manual_seed(seed)
    return nn.Linear(in_size, out_size)


def run_reference(module, x, grad_out):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def check_column_parallel(rank, tp, group, sequence_parallel, gather_output):
    what = f"ColumnParallelLinear(sp={sequence_parallel}, gather_output={gather_output})"
    reference = reference_linear(H, OUT, seed=1)
    x, dy = randn(S, B, H, seed=2), randn(S, B, OUT, seed=3)
    y_ref, dx_ref = run_reference(reference, x, dy)

    layer = ColumnParallelLinear(H, OUT, group=group, gather_output=gather_output,
                                 sequence_parallel=sequence_parallel)
    load_shards(layer, reference, rank, tp)
    x_local = shard(x, 0, rank, tp) if sequence_parallel else x
    y_local, dy_local = ((y_ref, dy) if gather_output
                         else (shard(y_ref, -1, rank, tp), shard(dy, -1, rank, tp)))
    y, dx = forward_backward(layer, x_local, dy_local)
    close(y, y_local, f"{what} output")
    close(dx, shard(dx_ref, 0, rank, tp) if sequence_parallel else dx_ref, f"{what} input grad")
    check_grads_equal(layer, reference, group, what)


def check_row_parallel(rank, tp, group, sequence_parallel, input_is_parallel):
    what = f"RowParallelLinear(sp={sequence_parallel}, input_is_parallel={input_is_parallel})"
    reference = reference_linear(OUT, H, seed=4)
    x, dy = randn(S, B, OUT, seed=5), randn(S, B, H, seed=6)
    y_ref, dx_ref = run_reference(reference, x, dy)

    layer = RowParallelLinear(OUT, H, group=group, input_is_parallel=input_is_parallel,
                              sequence_parallel=sequence_parallel)
    load_shards(layer, reference, rank, tp)
    x_local = shard(x, -1, rank, tp) if input_is_parallel else x
    y_local, dy_local = ((shard(y_ref, 0, rank, tp), shard(dy, 0, rank, tp))
                         if sequence_parallel else (y_ref, dy))
    y, dx = forward_backward(layer, x_local, dy_local)
    close(y, y_local, f"{what} output")
    close(dx, shard(dx_ref, -1, rank, tp) if input_is_parallel else dx_ref, f"{what} input grad")
    assert layer.bias.sequence_parallel == sequence_parallel
    allreduce_sequence_parallel_grads(layer.parameters(), group)
    check_grads_equal(layer, reference, group, what)


def check_vocab_parallel_embedding(rank, tp, group):
    torch.manual_seed(7)
    reference = nn.Embedding(VOCAB, H)
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(8))
    tokens[0, :VOCAB // 2] = torch.arange(0, VOCAB, 2)           # every rank's rows are hit
    dy = randn(B, S, H, seed=9)
    y_ref = reference(tokens)
    y_ref.backward(dy)

    layer = VocabParallelEmbedding(VOCAB, H, group=group)
    load_shards(layer, reference, rank, tp)
    y = layer(tokens)
    y.backward(dy)
    close(y, y_ref, "VocabParallelEmbedding output")
    check_grads_equal(layer, reference, group, "VocabParallelEmbedding")

    with pytest.raises(ConfigError, match=f"{VOCAB + 1} is not divisible by .* {tp}"):
        VocabParallelEmbedding(VOCAB + 1, H, group=group)


def check_vocab_parallel_cross_entropy(rank, tp, group):
    # Large logits exercise the max subtraction; the targets hit every rank's shard.
    logits = 20 * randn(S, B, VOCAB, seed=10)
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(11))
    target[:, 0] = torch.arange(S) * VOCAB // S
    grad_loss = randn(S, B, seed=12)

    full = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none")
    loss_ref = loss_ref.view(S, B)
    loss_ref.backward(grad_loss)

    local = shard(logits, -1, rank, tp).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    loss.backward(grad_loss)
    close(loss.detach(), loss_ref.detach(), "vocab_parallel_cross_entropy loss")
    close(local.grad, shard(full.grad, -1, rank, tp), "vocab_parallel_cross_entropy grad")


# ---------------------------------------------------------------- dropout RNG tracker

def check_rng_tracker(rank, tp, group):
    seed = 1234
    torch.manual_seed(seed)                  # the default generator: same on every TP rank
    tracker = build_rng_tracker(seed, rank, "cpu")
    ones = torch.ones(256)

    outside = F.dropout(ones, 0.5)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)
    masks_out, masks_in = gather(outside[None], 0, group), gather(inside[None], 0, group)
    for r in range(1, tp):
        assert torch.equal(masks_out[r], masks_out[0]), "dropout outside fork differs across TP"
        assert not torch.equal(masks_in[r], masks_in[0]), "dropout inside fork equal across TP"

    # fork() leaves the default stream where it was: `after` is the default's second draw.
    torch.manual_seed(seed)
    F.dropout(ones, 0.5)
    assert torch.equal(after, F.dropout(ones, 0.5)), "fork() disturbed the default generator"

    # Inside fork the draws come from a generator seeded with model_parallel_seed.
    assert model_parallel_seed(seed, rank) == seed + 2718 + rank
    with build_rng_tracker(seed, rank, "cpu").fork():
        draw = torch.rand(16)
    expected = torch.rand(16, generator=torch.Generator().manual_seed(seed + 2718 + rank))
    assert torch.equal(draw, expected), "fork state is not model_parallel_seed's"

    # get_states / set_states restore the tracked stream (checkpoint resume).
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(16)
    tracker.set_states(saved)
    with tracker.fork():
        again = torch.rand(16)
    assert torch.equal(first, again), "set_states did not restore the tracked RNG state"

    # Attention dropout acts on this rank's heads: it forks to draw, and only to draw.
    for dropout, forks in ((0.0, 0), (0.1, 1)):
        counting = CountingTracker()
        attention = SelfAttention(tiny_gpt_config(num_attention_heads=4, kv_channels=2,
                                                  hidden_size=H, attention_dropout=dropout),
                                  group, counting)
        attention(randn(S, B, H, seed=5), None)
        assert counting.forks == forks, f"attention dropout {dropout}: {counting.forks} forks"


class CountingTracker:
    def __init__(self):
        self.forks = 0

    @contextlib.contextmanager
    def fork(self, name=None):
        self.forks += 1
        yield


# ---------------------------------------------------------------- one spawn per TP size

def run_all_checks(rank, tp):
    group = dist.group.WORLD
    check_mappings(rank, tp, group)
    check_size_one_groups_are_identity(rank, tp)
    for sequence_parallel in (False, True):
        for gather_output in (False, True):
            check_column_parallel(rank, tp, group, sequence_parallel, gather_output)
        for input_is_parallel in (True, False):
            check_row_parallel(rank, tp, group, sequence_parallel, input_is_parallel)
    check_vocab_parallel_embedding(rank, tp, group)
    check_vocab_parallel_cross_entropy(rank, tp, group)
    check_rng_tracker(rank, tp, group)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_layers_match_unsharded_reference(tp):
    run_distributed(tp, run_all_checks)
