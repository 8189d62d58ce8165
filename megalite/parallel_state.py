"""The rank grid (docs/design.md §2) and its process groups, as one object passed down.

Ranks are laid out TP fastest, then CP (context parallel), then DP, then PP (Megatron's
order):
    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))
so a tensor-parallel group is consecutive ranks (one node, fast links) and pipeline stages
are far apart. With CP = 1 the CP axis vanishes. The arithmetic is pure (`RankGrid`), so it
is tested without processes; `ParallelState` builds the torch.distributed groups from it once.

Expert parallelism (EP, docs/design.md "Expert parallelism") does not add ranks: it is carved
out of DP x CP, as Megatron's expert grid is with the expert TP size equal to TP. Number the
DP x CP ranks of one (TP rank, PP rank) by `cp + CP * dp`; EP groups are runs of EP
consecutive ones, and the expert-data-parallel group is every EP-th one:
    ep_rank = (cp + CP * dp) % EP,   expert_dp_rank = (cp + CP * dp) // EP
An EP group holds all the experts once; an expert-DP group holds the same experts, and
sums their gradients and shards their ZeRO-1 state.

Hybrid sharding (--num-distributed-optimizer-instances N, docs/design.md "Hybrid sharding")
does not add ranks either: each DP x CP group (and each expert-DP group) splits into N
replicas of S = size / N consecutive ranks, the shard groups (a node, or a few); a replica
group holds the ranks with the same shard index in every replica:
    shard group j = g[j*S:(j+1)*S],   replica group i = g[i::S]
Sharded state lives within a shard group; only the replica groups cross it (Megatron's
intra- and inter-distributed-optimizer-instance groups).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.errors import ConfigError


@dataclass(frozen=True)
class RankGrid:
    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    num_distributed_optimizer_instances: int = 1

    def __post_init__(self):
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        cp = self.context_parallel_size
        if tp <= 0 or pp <= 0 or cp <= 0 or self.world_size % (tp * cp * pp):
            context = f"--context-parallel-size={cp} x " if cp != 1 else ""
            raise ConfigError(f"world size {self.world_size} is not divisible by "
                              f"--tensor-model-parallel-size={tp} x {context}"
                              f"--pipeline-model-parallel-size={pp}")
        ep = self.expert_model_parallel_size
        if ep <= 0 or self.dp_cp_size % ep:
            raise ConfigError(f"--expert-model-parallel-size={ep} must divide data x context "
                              f"parallel = {self.data_parallel_size} x {cp} = {self.dp_cp_size}")
        n = self.num_distributed_optimizer_instances
        if n <= 0 or self.dp_cp_size % n or self.expert_data_parallel_size % n:
            what = (f"expert-data-parallel (DP x CP / EP = {self.expert_data_parallel_size})"
                    if n > 0 and self.dp_cp_size % n == 0 else
                    f"data x context parallel = {self.data_parallel_size} x {cp} = "
                    f"{self.dp_cp_size}")
            raise ConfigError(f"--num-distributed-optimizer-instances={n} must divide {what}")

    @property
    def data_parallel_size(self) -> int:
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        return self.world_size // (model_parallel * self.context_parallel_size)

    @property
    def dp_cp_size(self) -> int:
        """DP x CP: the ranks gradients are summed over and ZeRO-1 shards its state over."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """(DP x CP) / EP: the ranks holding the same experts."""
        return self.dp_cp_size // self.expert_model_parallel_size

    @property
    def shard_size(self) -> int:
        """DP x CP / N: the ranks one replica's sharded state is spread over."""
        return self.dp_cp_size // self.num_distributed_optimizer_instances

    @property
    def expert_shard_size(self) -> int:
        """Expert-DP / N: the ranks one replica's expert state is spread over."""
        return self.expert_data_parallel_size // self.num_distributed_optimizer_instances

    def replica_rank(self, rank: int) -> int:
        """Which of the N replicas (shard groups) a global rank belongs to."""
        return self._dp_cp_index(rank) // self.shard_size

    def expert_rank(self, rank: int) -> int:
        """The EP rank of a global rank: which block of experts it holds."""
        return self._dp_cp_index(rank) % self.expert_model_parallel_size

    def _dp_cp_index(self, rank: int) -> int:
        return self.context_rank(rank) + self.context_parallel_size * self.coordinates(rank)[1]

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        tp, cp, dp = (self.tensor_model_parallel_size, self.context_parallel_size,
                      self.data_parallel_size)
        return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank (its CP rank: context_rank)."""
        tp, cp, dp = (self.tensor_model_parallel_size, self.context_parallel_size,
                      self.data_parallel_size)
        return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)

    def context_rank(self, rank: int) -> int:
        """The CP rank of a global rank: which pair of sequence chunks it holds."""
        return (rank // self.tensor_model_parallel_size) % self.context_parallel_size

    def _groups_varying(self, axes: str) -> list[list[int]]:
        """Rank lists in which only the named axes ('t', 'c', 'd', 'p') vary."""
        sizes = {"t": self.tensor_model_parallel_size, "c": self.context_parallel_size,
                 "d": self.data_parallel_size, "p": self.pipeline_model_parallel_size}
        fixed = [a for a in "tcdp" if a not in axes]
        groups = {}
        for rank in range(self.world_size):
            coords = dict(zip("tdp", self.coordinates(rank)), c=self.context_rank(rank))
            groups.setdefault(tuple(coords[a] for a in fixed), []).append(rank)
        for ranks in groups.values():
            if len(ranks) != math.prod(sizes[a] for a in axes):
                raise RuntimeError(f"rank grid bug: group {ranks} for axes {axes}")
        return sorted(groups.values())

    def tensor_groups(self) -> list[list[int]]:
        return self._groups_varying("t")

    def context_groups(self) -> list[list[int]]:
        """The ranks sharing one sequence's chunks (ring attention's ring)."""
        return self._groups_varying("c")

    def data_groups(self) -> list[list[int]]:
        return self._groups_varying("d")

    def dp_cp_groups(self) -> list[list[int]]:
        """DP x CP: every rank holding the same model shard. Gradients are summed and
        ZeRO-1 shards laid over it (Megatron's data-parallel group with CP)."""
        return self._groups_varying("cd")

    def pipeline_groups(self) -> list[list[int]]:
        return self._groups_varying("p")

    def expert_groups(self) -> list[list[int]]:
        """EP: EP ranks consecutive in the DP x CP index, together holding every expert
        (Megatron's expert_model_parallel_group); the tokens' all-to-all runs over it."""
        ep = self.expert_model_parallel_size
        return sorted(g[i:i + ep] for g in self.dp_cp_groups() for i in range(0, len(g), ep))

    def expert_data_groups(self) -> list[list[int]]:
        """Expert-DP: the (DP x CP) / EP ranks holding the same experts; expert gradients
        are summed and expert ZeRO-1 shards laid over it (Megatron's
        expert_data_parallel_group)."""
        ep = self.expert_model_parallel_size
        return sorted(g[i::ep] for g in self.dp_cp_groups() for i in range(ep))

    def shard_groups(self) -> list[list[int]]:
        """A DP x CP group cut into N runs of consecutive ranks: the ranks ZeRO-1 and FSDP2
        shard over (the whole DP x CP group when N = 1)."""
        return _split(self.dp_cp_groups(), self.num_distributed_optimizer_instances)

    def replica_groups(self) -> list[list[int]]:
        """The ranks holding the same shard in each of the N replicas: the sharded
        gradients are all-reduced over them (one rank each when N = 1)."""
        return _strided(self.dp_cp_groups(), self.num_distributed_optimizer_instances)

    def replica_mesh(self, rank: int, expert: bool = False) -> list[list[int]]:
        """The N x S ranks of the DP x CP group (expert-DP group for `expert`) holding
        `rank`: row i is replica i's shard group (FSDP2's 2-D DeviceMesh under HSDP)."""
        whole = self.expert_data_groups() if expert else self.dp_cp_groups()
        return _split([next(g for g in whole if rank in g)],
                      self.num_distributed_optimizer_instances)

    def expert_shard_groups(self) -> list[list[int]]:
        """An expert-DP group cut the same way: within one dense shard group."""
        return _split(self.expert_data_groups(), self.num_distributed_optimizer_instances)

    def expert_replica_groups(self) -> list[list[int]]:
        return _strided(self.expert_data_groups(), self.num_distributed_optimizer_instances)

    def model_parallel_groups(self) -> list[list[int]]:
        """TP x PP: every rank holding a piece of one model replica."""
        return self._groups_varying("tp")

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline: they hold the tied input
        embedding and output layer, whose grads must be summed across them."""
        return [sorted({ranks[0], ranks[-1]}) for ranks in self.pipeline_groups()]


def _split(groups: list[list[int]], n: int) -> list[list[int]]:
    """Each group cut into n runs of consecutive members."""
    size = len(groups[0]) // n
    return sorted(g[i:i + size] for g in groups for i in range(0, len(g), size))


def _strided(groups: list[list[int]], n: int) -> list[list[int]]:
    """The members at the same place of each of a group's n runs."""
    size = len(groups[0]) // n
    return sorted(g[i::size] for g in groups for i in range(size))


def print_rank_0(message: str):
    if dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str):
    """Megatron prints training logs from the last rank, which holds the loss under PP."""
    if dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def num_microbatches(global_batch_size: int, micro_batch_size: int,
                     data_parallel_size: int = 1) -> int:
    """Micro-batches per step of each of `data_parallel_size` ranks sharing the global batch
    evenly (of the whole global batch at the default 1)."""
    if global_batch_size % (micro_batch_size * data_parallel_size):
        dp = f" x data-parallel size {data_parallel_size}" if data_parallel_size > 1 else ""
        raise ConfigError(f"--global-batch-size={global_batch_size} is not divisible by "
                          f"--micro-batch-size={micro_batch_size}{dp}")
    return global_batch_size // (micro_batch_size * data_parallel_size)


def group_size(group) -> int:
    """Size of a process group; None stands for "no group" (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def to_collective_device(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` itself where a collective over `group` can take it, else a copy on this
    rank's GPU: NCCL has no host path, and --optimizer-cpu-offload keeps parameter shards,
    gradients and optimizer state (and what is computed from them) on the host; gloo takes
    either. Every collective on a tensor that may be on the host goes through here."""
    # gpu_check: torchrun_nccl
    if tensor.device.type != "cuda" and dist.get_backend(group) == "nccl":
        return tensor.to(torch.cuda.current_device())
    return tensor


def all_reduce_anywhere(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM):
    """dist.all_reduce in place, also of a host tensor over NCCL: reduced in a copy on
    the GPU (to_collective_device), copied back."""
    on_device = to_collective_device(tensor, group)
    dist.all_reduce(on_device, op=op, group=group)
    if on_device is not tensor:
        tensor.copy_(on_device)


def all_reduce_over(tensor: torch.Tensor, groups: list, op=dist.ReduceOp.SUM):
    """all_reduce_anywhere over each of `groups` that has several ranks, in turn."""
    for group in groups:
        if group_size(group) > 1:
            all_reduce_anywhere(tensor, group, op)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """All-gather x from every rank into out (concatenated along dim 0). x may be this
    rank's own block of out (in place). Returns the work handle when async_op."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single and deprecated the old
    # name (a FutureWarning per call); setup.py allows torch >= 2.8, which has only the old.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        out, x, group=group, async_op=async_op)


def all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each rank -> [size * n, ...], rank 0's block first (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x, group=group)
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """Sum x over the ranks and keep this rank's block of dim 0 in out. out may be that
    block of x itself (in place). Returns the work handle when async_op."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        out, x, group=group, async_op=async_op)


class ParallelState:
    """This rank's coordinates and the process groups it belongs to.

    Every rank must call `new_group` for every group in the same order, so all groups are
    created here, once, and each rank keeps the ones that contain it.
    """

    def __init__(self, grid: RankGrid, rank: int, make_groups: bool = True):
        self._make_groups = make_groups
        self.grid = grid
        self.rank = rank
        self.tp_rank, self.dp_rank, self.pp_rank = grid.coordinates(rank)
        self.cp_rank = grid.context_rank(rank)
        self.tp_size, self.cp_size = grid.tensor_model_parallel_size, grid.context_parallel_size
        self.dp_size, self.dp_cp_size = grid.data_parallel_size, grid.dp_cp_size
        self.pp_size = grid.pipeline_model_parallel_size
        self.tp_group = self._make(grid.tensor_groups())
        self.dp_group = self._make(grid.data_groups())
        self.cp_group = self._make(grid.context_groups())
        self.dp_cp_group = self._make(grid.dp_cp_groups())
        self.pp_group = self._make(grid.pipeline_groups())
        self.mp_group = self._make(grid.model_parallel_groups())
        self.embedding_group = self._make(grid.embedding_groups())
        self.ep_rank = grid.expert_rank(rank)
        self.ep_size = grid.expert_model_parallel_size
        self.expert_dp_size = grid.expert_data_parallel_size
        self.ep_group = self._make(grid.expert_groups()) if self.ep_size > 1 else None
        self.expert_dp_group = (self._make(grid.expert_data_groups()) if self.ep_size > 1
                                else self.dp_cp_group)
        self._make_shard_groups(grid)

    def _make_shard_groups(self, grid: RankGrid):
        """The shard and replica groups of hybrid sharding (module docstring); with one
        replica the shard groups are the DP x CP and expert-DP groups, and no replica
        group is made."""
        self.num_replicas = grid.num_distributed_optimizer_instances
        self.replica_rank = grid.replica_rank(self.rank)
        self.shard_group, self.expert_shard_group = self.dp_cp_group, self.expert_dp_group
        self.replica_group = self.expert_replica_group = None
        if self.num_replicas == 1:
            return
        self.shard_group = self.expert_shard_group = self._make(grid.shard_groups())
        self.replica_group = self.expert_replica_group = self._make(grid.replica_groups())
        if self.ep_size > 1:
            self.expert_shard_group = self._make(grid.expert_shard_groups())
            self.expert_replica_group = self._make(grid.expert_replica_groups())

    @classmethod
    def single_process(cls) -> "ParallelState":
        """A world of one with no process groups (None, "no group": `group_size`), started
        distributed or not: the single-process model tests compare the layouts against."""
        return cls(RankGrid(1), 0, make_groups=False)

    def _make(self, all_ranks: list[list[int]]):
        if not self._make_groups:
            return None
        groups = [dist.new_group(ranks) for ranks in all_ranks]
        return next((g for g, ranks in zip(groups, all_ranks) if self.rank in ranks), None)
