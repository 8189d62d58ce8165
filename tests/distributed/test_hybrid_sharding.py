"""Hybrid sharding (--num-distributed-optimizer-instances N, docs/design.md "Hybrid sharding")
and FSDP2 with expert parallelism against one process (fp32, dropout 0): ZeRO-1 and FSDP2
(HSDP) at DP 4 with N = 2, HSDP with TP 2 + SP at 8 ranks, FSDP2 x EP 2 (MoE, dropless),
FSDP2 x EP 2 x TP 2 + SP, FSDP2 x EP 2 with N = 2 and FSDP2 with MoE at EP 1: the same
initial values, per-step losses and grad norms, and values after each update; each layout
shards over the groups it should (a shard group of DP / N ranks, a 2-D mesh, the experts
over expert-DP). One launch of 8 ranks."""

import pytest
import torch

from megalite.distributed.fsdp import is_fully_sharded
from megalite.layout_check import build_run, first_difference, run_layout
from megalite.parallel_state import group_size
from megalite.spawn import run_distributed
from megalite.tensor_parallel.params import is_dtensor, is_expert_parallel

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

STEPS = 3
DENSE = flags_with("--swiglu", "--disable-bias-linear", "--attention-dropout", "0",
                   "--hidden-dropout", "0", "--num-workers", "0", hidden_size=32,
                   ffn_hidden_size=64, seq_length=16, micro_batch_size=1, global_batch_size=8,
                   lr="3e-3")
MOE = [*DENSE, "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff",
       "0.1", "--moe-z-loss-coeff", "0.01", "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall"]
ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
FSDP = ["--use-torch-fsdp2"]
N2 = ["--num-distributed-optimizer-instances", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2"]
# name: (model, ranks, flags, (replicas, shard group size) of the dense parameters and
# (replicas, shard group size) of the experts)
LAYOUTS = {
    "ZeRO-1 DP 4, N 2": (DENSE, 4, ZERO1 + N2, (2, 2), None),
    "FSDP2 DP 4, N 2 (HSDP)": (DENSE, 4, FSDP + N2, (2, 2), None),
    "HSDP TP 2 + SP x DP 4, N 2": (DENSE, 8, FSDP + N2 + TP2, (2, 2), None),
    "FSDP2 MoE EP 1 x DP 2": (MOE, 2, FSDP, (1, 2), (1, 2)),
    "FSDP2 x EP 2 (DP 4)": (MOE, 4, FSDP + EP2, (1, 4), (1, 2)),
    "FSDP2 x EP 2 x TP 2 + SP": (MOE, 4, FSDP + EP2 + TP2, (1, 2), (1, 1)),
    "HSDP x EP 2 (DP 8), N 2": (MOE, 8, FSDP + EP2 + N2, (2, 4), (2, 2)),
}


def sharding(flags, ranks, rank) -> tuple[tuple, tuple | None]:
    """(replicas, shard size) of the dense parameters and of the experts, as built."""
    _, _, model, optimizer, _, _ = build_run(flags, ranks, rank, torch.device("cpu"))
    if model is None:
        return None
    dense, experts = set(), set()
    for p in model.parameters():
        if is_fully_sharded(model):
            mesh = p.device_mesh
            shape = (1, *mesh.shape) if mesh.ndim == 1 else tuple(mesh.shape)
            assert is_dtensor(p) and p.placements[-1].is_shard()
        else:
            bucket = optimizer.grad_buffer._where[id(p)][0]
            shape = (group_size(bucket.replica_group) if optimizer.sharded else 1, bucket.dp)
        (experts if is_expert_parallel(p) else dense).add(shape)
    assert len(dense) == 1 and len(experts) <= 1, (dense, experts)
    return dense.pop(), experts.pop() if experts else None


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    references = {id(model): run_layout(model, 1, 0, cpu, STEPS) for model in (DENSE, MOE)}
    problems = {}
    for name, (model, ranks, flags, dense, experts) in LAYOUTS.items():
        built = sharding(model + flags, ranks, rank)
        if built is not None and built != (dense, experts):
            problems[name] = f"sharded as {built}, expected {(dense, experts)}"
        run = run_layout(model + flags, ranks, rank, cpu, STEPS)
        difference = run and first_difference(run, references[id(model)])
        if difference:
            problems[name] = difference
    return problems


def test_hybrid_sharding_and_fsdp_experts_match_one_process():
    failures = dict(enumerate(run_distributed(8, _compare, timeout=600)))  # rank: layouts
    assert not any(failures.values()), failures
