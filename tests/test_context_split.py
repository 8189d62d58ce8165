"""The load-balanced split of a sequence over context-parallel ranks (docs/design.md §10),
against its closed form: CP rank i holds chunks i and 2 CP - 1 - i of 2 CP."""

import pytest
import torch

from megalite.context_split import local_positions, shard_batch
from megalite.data.sampler import CollateContextShard


def test_positions_closed_form():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_ranks_cover_the_sequence_once_with_equal_causal_work(cp):
    seq = 64
    parts = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # A causal query at position p attends p + 1 keys: every rank does the same work.
    assert len({int((p + 1).sum()) for p in parts}) == 1


def test_batch_follows_the_chunks():
    tokens = torch.arange(16).view(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": (tokens % 3).float()}
    mine = shard_batch(batch, 2, 1)
    assert mine["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(mine["labels"], mine["tokens"] + 100)
    assert torch.equal(mine["loss_mask"], (mine["tokens"] % 3).float())
    samples = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    collated = CollateContextShard(2, 1)(samples)
    assert all(torch.equal(collated[k], mine[k]) for k in batch)
