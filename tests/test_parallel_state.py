"""The rank grid against an independent construction: the ranks as a [PP, DP, TP] array
(TP fastest), whose rows along each axis are that axis's groups."""

import numpy as np
import pytest
import torch.distributed as dist

from megalite.errors import ConfigError
from megalite.parallel_state import ParallelState, RankGrid, num_microbatches


def layouts(max_world=64):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world // tp + 1):
                if world % (tp * pp) == 0:
                    yield world, tp, pp


def reference_groups(world, tp, pp, axis):
    """Groups along axis 0 (PP), 1 (DP) or 2 (TP) of arange(world).reshape(PP, DP, TP)."""
    grid = np.arange(world).reshape(pp, world // (tp * pp), tp)
    moved = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
    return sorted(map(list, moved.tolist()))


@pytest.mark.parametrize("world, tp, pp", list(layouts()))
def test_groups_match_reference(world, tp, pp):
    grid = RankGrid(world, tp, pp)
    assert grid.data_parallel_size * tp * pp == world
    assert grid.tensor_groups() == reference_groups(world, tp, pp, 2)
    assert grid.data_groups() == reference_groups(world, tp, pp, 1)
    assert grid.pipeline_groups() == reference_groups(world, tp, pp, 0)
    array = np.arange(world).reshape(pp, -1, tp)
    model_parallel = sorted(sorted(array[:, d, :].ravel().tolist())
                            for d in range(array.shape[1]))
    assert grid.model_parallel_groups() == model_parallel
    for rank in range(world):
        t, d, p = grid.coordinates(rank)
        assert array[p, d, t] == rank == grid.rank(t, d, p)


def test_tensor_groups_are_consecutive_ranks():
    grid = RankGrid(16, 4, 2)
    assert grid.tensor_groups()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.pipeline_groups()[0] == [0, 8]


def test_embedding_groups_are_first_and_last_stage():
    grid = RankGrid(16, 2, 4)  # DP 2
    assert grid.embedding_groups()[0] == [0, 12]
    assert RankGrid(4, 4, 1).embedding_groups() == [[0], [1], [2], [3]]


def test_world_size_not_divisible_is_named():
    with pytest.raises(ConfigError, match="world size 6.*=4.*=1"):
        RankGrid(6, 4, 1)


def test_single_process_degenerates(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        state = ParallelState(RankGrid(1), 0)
        assert (state.tp_rank, state.dp_rank, state.pp_rank) == (0, 0, 0)
        assert (state.tp_size, state.dp_size, state.pp_size) == (1, 1, 1)
        for group in (state.tp_group, state.dp_group, state.pp_group, state.mp_group,
                      state.embedding_group):
            assert dist.get_world_size(group) == 1
    finally:
        dist.destroy_process_group()


def context_parallel_layouts(max_world=16):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for cp in range(2, world // tp + 1):
                for pp in range(1, world // (tp * cp) + 1):
                    if world % (tp * cp * pp) == 0:
                        yield world, tp, cp, pp


@pytest.mark.parametrize("world, tp, cp, pp", list(context_parallel_layouts()))
def test_context_parallel_groups_match_reference(world, tp, cp, pp):
    """Megatron's order with CP: arange(world).reshape(PP, DP, CP, TP), TP fastest."""
    grid = RankGrid(world, tp, pp, cp)
    dp = world // (tp * cp * pp)
    assert grid.data_parallel_size == dp
    array = np.arange(world).reshape(pp, dp, cp, tp)

    def varying(*axes):
        moved = np.moveaxis(array, axes, range(4 - len(axes), 4))
        return sorted(sorted(g) for g in moved.reshape(-1, np.prod(
            [array.shape[a] for a in axes])).tolist())
    assert grid.tensor_groups() == varying(3)
    assert grid.context_groups() == varying(2)
    assert grid.data_groups() == varying(1)
    assert grid.pipeline_groups() == varying(0)
    assert grid.dp_cp_groups() == varying(1, 2)
    assert grid.model_parallel_groups() == varying(0, 3)
    for rank in range(world):
        t, d, p = grid.coordinates(rank)
        c = grid.context_rank(rank)
        assert array[p, d, c, t] == rank == grid.rank(t, d, p, c)


def test_context_parallel_world_size_not_divisible_is_named():
    with pytest.raises(ConfigError, match="world size 8.*=2.*--context-parallel-size=3"):
        RankGrid(8, 2, 1, 3)


def expert_layouts(max_world=16):
    for world, tp, cp, pp in [*context_parallel_layouts(max_world),
                              *((w, t, 1, p) for w, t, p in layouts(max_world))]:
        dp_cp = world // (tp * pp)
        for ep in range(2, dp_cp + 1):
            if dp_cp % ep == 0:
                yield world, tp, cp, pp, ep


@pytest.mark.parametrize("world, tp, cp, pp, ep", list(expert_layouts()))
def test_expert_groups_match_reference(world, tp, cp, pp, ep):
    """Megatron's expert grid with the expert TP size = TP (order tp-ep-dp-pp): the DP x CP
    ranks of one (TP, PP) position, in order, reshaped to [expert-DP, EP]: rows are EP
    groups, columns expert-DP groups."""
    grid = RankGrid(world, tp, pp, cp, ep)
    array = np.arange(world).reshape(pp, -1, tp)  # the middle axis: DP x CP, CP fastest
    blocks = [array[p, :, t].reshape(-1, ep) for p in range(pp) for t in range(tp)]
    assert grid.expert_groups() == sorted(row.tolist() for b in blocks for row in b)
    assert grid.expert_data_groups() == sorted(col.tolist() for b in blocks for col in b.T)
    assert grid.expert_data_parallel_size * ep == grid.dp_cp_size
    for b in blocks:
        for (edp, e), rank in np.ndenumerate(b):
            assert grid.expert_rank(int(rank)) == e


def test_expert_groups_megatron_example():
    """World 8, TP 2, EP 2 (DP 4): Megatron's RankGenerator(tp=2, ep=2, dp=2, pp=1,
    order="tp-ep-dp-pp") puts rank = tp + 2 * (ep + 2 * edp)."""
    grid = RankGrid(8, 2, 1, 1, 2)
    assert grid.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.expert_data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cp_grid = RankGrid(8, 1, 1, 2, 4)  # DP 4 x CP 2, EP 4: CP ranks are EP neighbours
    assert cp_grid.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_expert_parallel_size_not_dividing_is_named():
    with pytest.raises(ConfigError, match="--expert-model-parallel-size=3 must divide.*= 4"):
        RankGrid(8, 2, 1, 1, 3)


def test_num_microbatches_splits_the_global_batch():
    # 32 samples, micro-batches of 2: 16 in all, 4 for each of 4 DP ranks.
    assert (num_microbatches(32, 2), num_microbatches(32, 2, 4)) == (16, 4)
    with pytest.raises(ConfigError, match=r"--global-batch-size=30 is not divisible by "
                                          r"--micro-batch-size=4 x data-parallel size 2"):
        num_microbatches(30, 4, 2)
    with pytest.raises(ConfigError, match=r"by --micro-batch-size=4$"):
        num_microbatches(30, 4)


def replica_layouts(max_world=16):
    for world, tp, cp, pp, ep in [*((w, t, c, p, 1) for w, t, c, p in
                                    context_parallel_layouts(max_world)),
                                  *((w, t, 1, p, 1) for w, t, p in layouts(max_world)),
                                  *expert_layouts(max_world)]:
        edp = world // (tp * pp * ep)
        for n in range(2, edp + 1):
            if edp % n == 0:
                yield world, tp, cp, pp, ep, n


@pytest.mark.parametrize("world, tp, cp, pp, ep, n", list(replica_layouts()))
def test_shard_and_replica_groups_match_reference(world, tp, cp, pp, ep, n):
    """Hybrid sharding: the DP x CP ranks of one (TP, PP) position, in order, reshaped to
    [N, S]: rows are shard groups (consecutive), columns replica groups; the expert-DP
    ranks (the EP-strided columns of the expert grid) reshaped the same way."""
    grid = RankGrid(world, tp, pp, cp, ep, num_distributed_optimizer_instances=n)
    array = np.arange(world).reshape(pp, -1, tp)
    blocks = [array[p, :, t].reshape(n, -1) for p in range(pp) for t in range(tp)]
    assert grid.shard_groups() == sorted(row.tolist() for b in blocks for row in b)
    assert grid.replica_groups() == sorted(col.tolist() for b in blocks for col in b.T)
    experts = [array[p, :, t].reshape(-1, ep)[:, e].reshape(n, -1)
               for p in range(pp) for t in range(tp) for e in range(ep)]
    assert grid.expert_shard_groups() == sorted(row.tolist() for b in experts for row in b)
    assert grid.expert_replica_groups() == sorted(col.tolist() for b in experts for col in b.T)
    for b in blocks:
        for (replica, _), rank in np.ndenumerate(b):
            assert grid.replica_rank(int(rank)) == replica
    # Each expert shard group lies within one dense shard group (one node's fast links).
    dense = {r: tuple(g) for g in grid.shard_groups() for r in g}
    assert all(len({dense[r] for r in g}) == 1 for g in grid.expert_shard_groups())


def test_replicas_not_dividing_are_named():
    with pytest.raises(ConfigError, match="--num-distributed-optimizer-instances=3 must divide "
                                          "data x context parallel = 4 x 1 = 4"):
        RankGrid(8, 2, 1, num_distributed_optimizer_instances=3)
    with pytest.raises(ConfigError, match="=4 must divide expert-data-parallel.* = 2"):
        RankGrid(8, 1, 1, 1, 4, num_distributed_optimizer_instances=4)
