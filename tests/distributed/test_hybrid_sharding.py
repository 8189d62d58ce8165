"""Hybrid sharding (--num-distributed-optimizer-instances N, docs/design.md "Hybrid sharding")
and FSDP2 with expert parallelism against one process (fp32, dropout 0): ZeRO-1 and FSDP2
(HSDP) at DP 4 with N = 2, HSDP with TP 2 + SP at 8 ranks, FSDP2 x EP 2 (MoE, dropless),
FSDP2 x EP 2 x TP 2 + SP, FSDP2 x EP 2 with N = 2, FSDP2 with MoE at EP 1, and ZeRO-1 and
HSDP with N = 2 composed with PP 2 (tied embeddings on two stages), CP 2 and
--optimizer-cpu-offload: the same initial values, per-step losses and grad norms, and values
after each update; each layout
shards over the groups it should (a shard group of DP / N ranks, a 2-D mesh, the experts
over expert-DP), rank 0 steps the elements the memory planner counts, and the log line's
cross-replica bytes per step are those counted at the replica groups' collectives. And a run handed on through checkpoints at 8 ranks, HSDP x EP 2 x TP 2 ->
ZeRO-1 -> FSDP2 x EP 2 -> ZeRO-1 with N = 4 -> HSDP, logs the uninterrupted run's losses and
ends with the tensors a one-process load reads of it (its log lines carry the cross-replica
bytes where N > 1), and ZeRO-1 with N = 2 and PowerSGD logs them on the uncompressed steps
only. One launch of 8 ranks."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.common.wire_bytes import counting_wire_bytes
from megalite.checkpointing.loading import SavedCheckpoint
from megalite.checkpointing.storage import find_checkpoint_to_load, read_metadata
from megalite.distributed.fsdp import is_fully_sharded
from megalite.layout_check import FP32, build_run, first_difference, run_layout
from megalite.memory_estimate.weights import weights_and_optimizer
from megalite.parallel_state import group_size
from megalite.spawn import run_distributed
from megalite.step_report import cross_replica_bytes
from megalite.tensor_parallel.params import is_dtensor, is_expert_parallel
from megalite.training_log import parse_log

from tests.helpers import flags_with, train_in_rank

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
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
OFFLOAD = ["--optimizer-cpu-offload"]
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
    "ZeRO-1 PP 2 x DP 4, N 2": (DENSE, 8, ZERO1 + N2 + PP2, (2, 2), None),
    "HSDP PP 2 x DP 4, N 2": (DENSE, 8, FSDP + N2 + PP2, (2, 2), None),
    "ZeRO-1 CP 2 x DP 2, N 2": (DENSE, 4, ZERO1 + N2 + CP2, (2, 2), None),
    "HSDP CP 2 x DP 2, N 2": (DENSE, 4, FSDP + N2 + CP2, (2, 2), None),
    "ZeRO-1 DP 4, N 2, optimizer offload": (DENSE, 4, ZERO1 + N2 + OFFLOAD, (2, 2), None),
    "HSDP DP 4, N 2, optimizer offload": (DENSE, 4, FSDP + N2 + OFFLOAD, (2, 2), None),
}


def sharding(flags, ranks, rank) -> tuple[tuple, tuple | None]:
    """(replicas, shard size) of the dense parameters and of the experts, as built; on
    rank 0 (the planner's) also the elements its optimizer steps against the planner's."""
    config, state, model, optimizer, runner, batches = build_run(flags, ranks, rank,
                                                                 torch.device("cpu"))
    if model is None:
        return None
    owned = sum(s.main.numel() for s in optimizer.segments)
    planned = weights_and_optimizer(config, 0)["owned"]
    if rank == 0 and owned != planned:
        return f"rank 0 steps {owned} elements, the planner says {planned}"
    if (crossed := replica_bytes(config, state, runner, batches)) is not None:
        return crossed
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


def replica_bytes(config, state, runner, batches) -> str | None:
    """What the log line's cross-replica bytes per step differs from the bytes counted at
    the collectives over the replica groups in a step, if it does."""
    logged = cross_replica_bytes(config, state, runner)
    if state.num_replicas == 1:
        return None if logged is None else f"cross-replica bytes {logged} at one replica"
    counted = {}
    with counting_wire_bytes(counted):
        runner.train_step([next(batches) for _ in range(config.training.num_microbatches)])
    groups = {state.replica_group, state.expert_replica_group} - {None}
    crossed = sum(counted.get(group, 0.0) for group in groups)
    return None if logged == crossed > 0 else \
        f"cross-replica bytes per step: log line {logged}, counted {crossed}"


def _compare(rank, world_size):
    cpu = torch.device("cpu")
    references = {id(model): run_layout(model, 1, 0, cpu, STEPS) for model in (DENSE, MOE)}
    problems = {}
    for name, (model, ranks, flags, dense, experts) in LAYOUTS.items():
        built = sharding(model + flags, ranks, rank)
        if isinstance(built, str):
            problems[name] = built
        elif built is not None and built != (dense, experts):
            problems[name] = f"sharded as {built}, expected {(dense, experts)}"
        run = run_layout(model + flags, ranks, rank, cpu, STEPS)
        difference = run and first_difference(run, references[id(model)])
        if difference:
            problems[name] = difference
    return problems


# pretrain_gpt.py's runs of the MoE model at 8 ranks (the log line's 7 digits compared).
LOGGED = ["--log-interval", "1", "--eval-iters", "0", "--distributed-backend", "gloo",
          "--lr-decay-iters", "5", "--train-iters"]
RUN = [*MOE, *LOGGED]
CHAIN = [FSDP + EP2 + TP2 + N2, ["--use-distributed-optimizer"], FSDP + EP2,
         ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4"],
         FSDP + N2]


def _chain(rank, world_size, root) -> dict[str, dict[int, str]]:
    """The losses logged by the uninterrupted run (ZeRO-1, N 1) and by each link of CHAIN,
    the i-th training to iteration i from the (i-1)-th's checkpoint."""
    def losses(flags):
        logs = parse_log(train_in_rank(rank, world_size, flags))
        crossing = {log["cross_replica_bytes"] is not None for log in logs}
        if logs and crossing != {"--num-distributed-optimizer-instances" in flags}:
            return f"cross-replica bytes logged {crossing} with flags {flags}"
        return {log["iteration"]: log["lm_loss"] for log in logs}
    out = {"straight": losses([*RUN, str(len(CHAIN)), "--use-distributed-optimizer",
                               "--save", f"{root}/straight"])}
    for i, flags in enumerate(CHAIN, start=1):
        load = ["--load", f"{root}/chain"] if i > 1 else []
        out[" ".join(flags)] = losses([*RUN, str(i), *flags, "--save", f"{root}/chain", *load])
        dist.barrier()  # the checkpoint is whole before the next link reads it
    return out


def _compressed(rank, world_size) -> dict[int, float | None]:
    """The cross-replica bytes logged per iteration by ZeRO-1 with N = 2 and PowerSGD from
    iteration 3 (its compressed reduction spans DP x CP, not the replicas' all-reduce)."""
    logs = parse_log(train_in_rank(rank, world_size, [
        *DENSE, *LOGGED, "3", "--use-distributed-optimizer", *N2, "--grad-compression", "powersgd",
        "--powersgd-start-iter", "2"]))
    return {log["iteration"]: log["cross_replica_bytes"] for log in logs}


def _launch(rank, world_size, root):
    return (_compare(rank, world_size), _chain(rank, world_size, root),
            _compressed(rank, world_size))


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_sharding")
    return root, run_distributed(8, _launch, str(root), timeout=600)


def test_hybrid_sharding_and_fsdp_experts_match_one_process(launch):
    failures = {rank: problems for rank, (problems, *_) in enumerate(launch[1])}
    assert not any(failures.values()), failures


def _saved(save: Path) -> SavedCheckpoint:
    directory = find_checkpoint_to_load(save)[1]
    return SavedCheckpoint(directory, read_metadata(directory))


def test_checkpoints_hand_a_run_on_across_hsdp_fsdp2_zero1_and_ep(launch):
    """Each link resumes at another layout with the uninterrupted run's loss; the last
    checkpoint (HSDP: one replica's files) holds, assembled as one process loads it, the
    uninterrupted run's weights, main copies and Adam moments."""
    root, results = launch
    runs = results[-1][1]
    links = {i: loss for name, logged in runs.items() if name != "straight"
             for i, loss in logged.items()}
    assert [sorted(runs[" ".join(flags)]) for flags in CHAIN] == [[i] for i in range(1, 6)]
    for i, loss in runs["straight"].items():
        assert abs(float(links[i]) - float(loss)) <= 2e-6 * float(loss), (i, runs)
    straight, chained = _saved(root / "straight"), _saved(root / "chain")
    assert chained.layout["num_distributed_optimizer_instances"] == 2
    assert sorted(straight.names) == sorted(chained.names)
    for name in straight.names:
        # fp32 round-off of other summation orders, grown by 5 Adam steps: the contract's
        # tolerance for values (layout_check.FP32); a moment to 1e-4 of its largest element.
        values = [(straight.param(name), chained.param(name))] + [
            (straight.optimizer_tensor(name, key), chained.optimizer_tensor(name, key))
            for key in ("main", "exp_avg", "exp_avg_sq")]
        values, moments = values[:2], values[2:]
        for (a, b), atol in [*((v, FP32.value_atol) for v in values),
                             *((m, 1e-4 * m[0].abs().max().item()) for m in moments)]:
            assert torch.allclose(a, b, rtol=FP32.value_rtol, atol=atol), \
                (name, (a - b).abs().max().item())


def test_log_line_has_no_cross_replica_bytes_on_compressed_steps(launch):
    logged = launch[1][-1][2]
    assert sorted(logged) == [1, 2, 3] and logged[1] == logged[2] > 0, logged
    assert logged[3] is None, logged
