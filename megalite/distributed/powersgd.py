"""PowerSGD (Vogels et al. 2019, Algorithm 1) on the gradient buffer's DP x CP reduction.

Each gradient matrix M (n x m; a >= 2-D gradient viewed as [shape[0], -1], as torch's hook
does) of a bucket is summed over the reduction group as two thin factors instead of itself:

    P = M Q            all-reduce P (one collective for the bucket's Ps)
    P = orth(P)
    Q = M^T P          all-reduce Q (one collective for the bucket's Qs)
    M ~ P Q^T          the decompressed sum, written back into the buffer

Vectors and matrices that `_should_compress` (torch's rule: n*m > rate*(n+m)*rank) turns
down are all-reduced as they are, in one collective per bucket. With error feedback each
rank adds to its next gradient what it lost: M - (its share 1/W of P Q^T), in fp32. With
warm start the next step's power iteration starts from this step's Q.

Scale: megalite's buffer holds each rank's share of the global-mean gradient (the loss is
normalised by the global token count) and sums it; torch's DDP hook holds each rank's local
mean and averages. The two differ by the factor W = DP x CP, which PowerSGD carries through
linearly (orth() undoes any scale), so summing Q where torch averages it gives torch's
result, and the error 'M - P Q^T / W' is torch's error divided by W.

What is torch's and what is not. `_orthogonalize` (Gram-Schmidt for rank <= 2 or half
precision, else QR) and `_should_compress` are torch's own functions, called here. Its hook
(`powerSGD_hook`) is not: it is a DDP communication hook, called by DDP's reducer on DDP's
buckets (a `GradBucket`), with no place for megalite's buffer, ZeRO-1 shards or tensor
parallelism, and it draws the first Q per bucket from one NumPy stream, so its Q depends on
how parameters fall into buckets. Here each matrix's first Q is drawn from a generator
seeded by (seed, the parameter's single-process name), whole (the full matrix's columns),
so every layout starts from the same Q.

Tensor parallelism: a TP shard is part of one matrix, and compressing shards apart would be
another (rank x TP) approximation. Instead the factor along the split dimension is split
too: a contraction over the split dimension (P = M Q for a row-parallel weight, Q = M^T P
for a column-parallel one) is summed over the TP group, and a split factor is gathered
whole to be orthogonalised. So PowerSGD at DPxTP computes what PowerSGD at DP does.
"""

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (_orthogonalize,
                                                                        _should_compress)

from megalite.config import GradCompressionConfig
from megalite.timers import NO_TIMERS, Timers
from megalite.parallel_state import all_gather_first_dim, group_rank, group_size
from megalite.tensor_parallel.params import partition_dim, single_process_name


def single_process_names(chunks: nn.ModuleList) -> dict[int, str]:
    """id(param) -> its name in the single-process model (a chunk's names are already
    global)."""
    return {id(p): single_process_name(name, p)
            for chunk in chunks for name, p in chunk.named_parameters()}


@dataclass
class Matrix:
    """One compressed gradient: its parameter, its single-process name, its local view
    n x m, the TP-split dimension of that view (None: whole), and the rank of its factors
    P (n x rank) and Q (m x rank)."""
    param: nn.Parameter
    name: str
    n: int
    m: int
    split: int | None
    rank: int


def plan_bucket(params: list[nn.Parameter], names: dict[int, str], config: GradCompressionConfig,
                tp_size: int) -> tuple[list[Matrix], list[nn.Parameter]]:
    """(compressed matrices, parameters reduced as they are) of one bucket. The decision
    and the rank use the full (TP-unsplit) matrix, so every layout compresses the same."""
    matrices, plain = [], []
    for param in params:
        split = partition_dim(param) if tp_size > 1 else None
        n, m = param.shape[0], param.numel() // max(param.shape[0], 1)
        if param.dim() < 2 or (split is not None and (split > 1 or param.dim() > 2)):
            plain.append(param)
            continue
        n_full, m_full = n * (tp_size if split == 0 else 1), m * (tp_size if split == 1 else 1)
        rank = min(n_full, m_full, config.rank)
        if not _should_compress(n_full, m_full, rank, config.min_compression_rate)[0]:
            plain.append(param)
            continue
        matrices.append(Matrix(param, names[id(param)], n, m, split, rank))
    return matrices, plain


def compressed_bytes(matrices: list[Matrix], plain: list[nn.Parameter], grad_bytes: int) -> int:
    """Bytes this rank puts into one compressed bucket's DP collectives: fp32 P and Q, the
    other gradients in the buffer's dtype."""
    factors = sum((mat.n + mat.m) * mat.rank for mat in matrices)
    return 4 * factors + grad_bytes * sum(p.numel() for p in plain)


def initial_q(name: str, m_full: int, rank: int, seed: int, step: int) -> torch.Tensor:
    """A fresh Q of the matrix `name` (m_full x rank, N(0, 1), not yet orthogonal) at
    `step`: one generator per (seed, step, name), so the draw does not depend on the
    buckets or the layout. Drawn on the host, as torch's hook draws it."""
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + step) * 1_000_033 + zlib.crc32(name.encode()))
    return torch.randn(m_full, rank, generator=generator)


class PowerSGD:
    """Compresses the DP x CP reduction of `buckets` (GradBuffer.buckets) once `steps`
    reaches config.start_iter. `names` maps id(param) to its single-process name; `group`
    is the reduction group, `tp_group` the tensor group (TP shards are parts of one matrix,
    module docstring). `count(tensor)` is told about every DP collective's payload."""

    def __init__(self, buckets, names: dict[int, str], config: GradCompressionConfig, group,
                 tp_group, seed: int, timers: Timers = NO_TIMERS):
        self.config, self.group, self.tp_group, self.seed = config, group, tp_group, seed
        self.world = group_size(group)
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.timers = timers
        self.plans = [plan_bucket(b.params, names, config, self.tp_size) for b in buckets]
        self.steps = 0
        """Reductions done (one per training step); compression from config.start_iter on."""
        self.errors: dict[str, torch.Tensor] = {}
        """Error feedback per compressed matrix (fp32, local n x m)."""
        self.qs: dict[str, torch.Tensor] = {}
        """The last step's Q per compressed matrix (fp32, local m x rank)."""

    @property
    def active(self) -> bool:
        return self.steps >= self.config.start_iter

    def reduce(self, buckets, count):
        """Sum every bucket over the group, compressed (the buffer then holds P Q^T)."""
        for bucket, (matrices, plain) in zip(buckets, self.plans):
            self._reduce_plain(plain, count)
            if matrices:
                self._reduce_matrices(matrices, bucket.flat.device, count)

    def _reduce_plain(self, params, count):
        if not params:
            return
        flat = torch.cat([p.main_grad.view(-1) for p in params])
        count(flat)
        dist.all_reduce(flat, group=self.group)
        for p, summed in zip(params, flat.split([p.numel() for p in params])):
            p.main_grad.view(-1).copy_(summed)

    def _reduce_matrices(self, matrices: list[Matrix], device, count):
        # The bucket's Ps, and its Qs, in one flat buffer each: one collective apiece.
        p_sizes, q_sizes = [a.n * a.rank for a in matrices], [a.m * a.rank for a in matrices]
        ps = torch.empty(sum(p_sizes), device=device)
        qs = torch.empty(sum(q_sizes), device=device)
        p_of = [p.view(a.n, a.rank) for a, p in zip(matrices, ps.split(p_sizes))]
        q_of = [q.view(a.m, a.rank) for a, q in zip(matrices, qs.split(q_sizes))]
        # The timer covers the local work and the small TP collectives, not the DP ones.
        with self.timers("grads-compress"):
            inputs = [self._input(a) for a in matrices]
            for a, M, p, q in zip(matrices, inputs, p_of, q_of):
                q.copy_(self._start_q(a, device))
                torch.matmul(M, q, out=p)
                if a.split == 1:  # P = sum over the TP shards of M_shard Q_shard
                    dist.all_reduce(p, group=self.tp_group)
        count(ps)
        dist.all_reduce(ps, group=self.group)
        with self.timers("grads-compress"):
            for a, M, p, q in zip(matrices, inputs, p_of, q_of):
                p.copy_(self._orthogonal(p, a.split == 0))
                torch.matmul(M.t(), p, out=q)
                if a.split == 0:  # Q = sum over the TP shards of M_shard^T P_shard
                    dist.all_reduce(q, group=self.tp_group)
        count(qs)
        dist.all_reduce(qs, group=self.group)
        with self.timers("grads-compress"):
            for a, M, p, q in zip(matrices, inputs, p_of, q_of):
                self._decompress(a, M, p, q)

    def _input(self, a: Matrix) -> torch.Tensor:
        """This rank's gradient matrix plus its error feedback, in fp32: accumulated into
        the error buffer itself (no copy of the gradients), which `_decompress` then turns
        into the new error."""
        grad = a.param.main_grad.view(a.n, a.m)
        if not self.config.error_feedback:
            return grad.float()
        if a.name not in self.errors:
            self.errors[a.name] = torch.zeros(a.n, a.m, device=grad.device)
        return self.errors[a.name].add_(grad)

    def _start_q(self, a: Matrix, device) -> torch.Tensor:
        """Warm start: last step's Q, orthogonalised (as torch's hook does); else a fresh
        draw, orthogonalised whole and then split."""
        if self.config.warm_start and a.name in self.qs:
            return self._orthogonal(self.qs[a.name].clone(), a.split == 1)
        full = initial_q(a.name, a.m * (self.tp_size if a.split == 1 else 1), a.rank, self.seed,
                         self.steps)
        full = self._orthogonal(full.to(device), False)
        return full.chunk(self.tp_size)[self.tp_rank] if a.split == 1 else full

    def _orthogonal(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """orth(x) by torch's `_orthogonalize`; a factor split over TP is gathered whole
        first (its columns' norms run over every TP rank's rows) and this rank's rows kept."""
        eps = self.config.orthogonalization_epsilon
        if not split:
            _orthogonalize(x.unsqueeze(0), eps)
            return x
        full = all_gather_first_dim(x, self.tp_group)
        _orthogonalize(full.unsqueeze(0), eps)
        return full.chunk(self.tp_size)[self.tp_rank]

    def _decompress(self, a: Matrix, M: torch.Tensor, p: torch.Tensor, q: torch.Tensor):
        approx = p @ q.t()  # the group's sum, approximated
        if self.config.error_feedback:
            # What this rank sent minus its share of what arrived (torch's error / W); M is
            # the error buffer (`_input`).
            M.sub_(approx / self.world)
        if self.config.warm_start:
            self.qs[a.name] = q.clone()
        a.param.main_grad.view(a.n, a.m).copy_(approx)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        return {"steps": self.steps, "errors": dict(self.errors), "qs": dict(self.qs)}

    def load_state_dict(self, state: dict):
        self.steps = state["steps"]
        self.errors = dict(state["errors"])
        self.qs = dict(state["qs"])

    def restart(self):
        """Back to uncompressed steps, no error and no Q: the state of a fresh run."""
        self.steps, self.errors, self.qs = 0, {}, {}
