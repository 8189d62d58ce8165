"""MicroBatchSampler: global batch b is samples [b*G, (b+1)*G) whatever DP is; resume is exact."""

import itertools

import pytest
import torch

from megalite.data.sampler import MicroBatchSampler, collate_samples
from megalite.errors import ConfigError


def micro_batches(total, consumed, mbs, rank, dp, gbs):
    return list(MicroBatchSampler(total, consumed, mbs, rank, dp, gbs))


@pytest.mark.parametrize("mbs,dp,gbs", [(1, 1, 1), (2, 1, 8), (2, 2, 8), (1, 4, 8), (3, 2, 12)])
def test_resume_at_k_yields_exactly_the_rest(mbs, dp, gbs):
    total = 10 * gbs + gbs // 2  # a partial last global batch is dropped
    for rank in range(dp):
        straight = micro_batches(total, 0, mbs, rank, dp, gbs)
        per_step = gbs // dp // mbs  # micro-batches per step on this rank
        assert len(straight) == 10 * per_step
        for step in range(11):
            resumed = micro_batches(total, step * gbs, mbs, rank, dp, gbs)
            assert resumed == straight[step * per_step:]
            assert len(MicroBatchSampler(total, step * gbs, mbs, rank, dp, gbs)) == len(resumed)


def test_global_batch_is_the_same_samples_in_the_same_order_for_any_dp():
    gbs, total = 16, 80
    for mbs in (1, 2, 4):
        for dp in (1, 2, 4):
            if gbs % (mbs * dp):
                continue
            per_rank = [micro_batches(total, 0, mbs, r, dp, gbs) for r in range(dp)]
            steps_per_rank = gbs // dp // mbs
            for step in range(total // gbs):
                joined = list(itertools.chain.from_iterable(
                    mb for r in range(dp)
                    for mb in per_rank[r][step * steps_per_rank:(step + 1) * steps_per_rank]))
                assert joined == list(range(step * gbs, (step + 1) * gbs)), (mbs, dp, step)
                assert all(len(mb) == mbs for r in range(dp) for mb in per_rank[r])


@pytest.mark.parametrize("args,match", [
    (dict(consumed=5), "consumed samples 5"),
    (dict(consumed=-8), "consumed samples"),
    (dict(consumed=104), "exceed"),
    (dict(gbs=6), "--global-batch-size=6"),
    (dict(rank=2), "rank 2"),
    (dict(mbs=0), "--micro-batch-size"),
])
def test_bad_arguments_are_config_errors(args, match):
    kw = dict(total=100, consumed=0, mbs=2, rank=0, dp=2, gbs=8)
    kw.update(args)
    with pytest.raises(ConfigError, match=match):
        MicroBatchSampler(kw["total"], kw["consumed"], kw["mbs"], kw["rank"], kw["dp"], kw["gbs"])


def test_consumed_equal_to_total_yields_nothing():
    assert micro_batches(64, 64, 2, 0, 2, 8) == []


def test_collate_and_dataloader():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return {"tokens": torch.full((5,), i, dtype=torch.int64),
                    "loss_mask": torch.ones(5, dtype=torch.float32)}

    sampler = MicroBatchSampler(32, 8, 2, 1, 2, 8)
    loader = torch.utils.data.DataLoader(Squares(), batch_sampler=sampler, collate_fn=collate_samples)
    batches = list(loader)
    assert len(batches) == len(sampler) == 6
    assert batches[0]["tokens"].shape == (2, 5) and batches[0]["tokens"].dtype == torch.int64
    assert batches[0]["loss_mask"].dtype == torch.float32
    assert batches[0]["tokens"][:, 0].tolist() == [12, 13]  # step 1, rank 1's first micro-batch
