"""Resume at another expert-parallel size (docs/design.md "Expert parallelism"): a run at
EP 2 x DP 2 with ZeRO-1 (expert optimizer shards over expert-DP) saves at iteration 2 and
goes on to 5; that checkpoint loaded at EP 4 (plain optimizer, whose expert state is
gathered over EP when it saves at iteration 4) continues 3 and 4, and that save loaded by
one process (EP 1) continues 5: every loss and grad norm the straight run's (fp32, dropout
0, to round-off). Then the replica check: the straight run's replicas agree, and an expert
changed on one rank is found in its expert-data-parallel group. One launch of 4 ranks."""

import pytest
import torch

from megalite.layout_check import step_problems
from megalite.memory_estimate.weights import grad_buckets, rank_parameters, weights_and_optimizer
from megalite.monitoring.moe_metrics import moe_report
from megalite.monitoring.replica_check import ReplicaMismatchError, check_all_replicas
from megalite.spawn import run_distributed

from tests.distributed.test_expert_parallel_layouts import BASE
from tests.helpers import train_steps
from tests.test_memory_estimate import built_buckets

pytestmark = pytest.mark.slow  # launches processes

ZERO_EP2 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
PLAIN_EP4 = ["--expert-model-parallel-size", "4"]


def _replica_check(model, state, rank) -> list[str]:
    """Healthy replicas pass; rank 2's copy of an expert (its expert-DP peer: rank 0) changed
    is named on every rank."""
    named = [(n.split(".", 1)[1], p) for n, p in model.named_parameters()]
    check_all_replicas(named, state, 5, torch.device("cpu"))
    expert = "decoder.layers.1.mlp.experts.linear_fc2.weight"
    if rank == 2:
        with torch.no_grad():
            dict(named)[expert][0, 0, 0] += 1.0
    try:
        check_all_replicas(named, state, 6, torch.device("cpu"))
    except ReplicaMismatchError as error:
        return [] if rank != 0 or f"rank(s) [2]" in str(error) and expert in str(error) \
            else [f"the error does not name rank 2 and {expert}: {error}"]
    return ["a changed expert was not found"]


def _resume(rank, world_size, directory):
    straight, model, state, config, runner = train_steps(BASE + ZERO_EP2, 4, rank, range(1, 6),
                                                         save=f"{directory}/a", save_at=2)
    # The log line's expert load counts all E experts' tokens under EP too.
    load = moe_report(model, config, state.tp_size, 5, torch.device("cpu"))[0]["expert_load"]
    replicas = _replica_check(model, state, rank) + ([] if load >= 1 else [f"load {load}"])
    at_ep4, *_ = train_steps(BASE + PLAIN_EP4, 4, rank, range(3, 5), load=f"{directory}/a",
                        save=f"{directory}/b", save_at=4)
    at_ep1 = train_steps(BASE, 1, rank, range(5, 6), load=f"{directory}/b")
    at_ep1 = at_ep1 and at_ep1[0]
    last = rank % 2 == 1 or rank == 0  # ranks whose loss the comparison may read
    return {"EP 4 from EP 2 ZeRO-1": step_problems(at_ep4, straight[2:4], last),
            "EP 1 from EP 4": step_problems(at_ep1, straight[4:], True) if at_ep1 else [],
            "replica check": replicas, "planner": _planner_problems(config, runner, rank)}


def _planner_problems(config, runner, rank) -> list[str]:
    """The memory planner's buckets are the real buffer's at EP 2 x DP 2 (expert buckets
    padded to expert-DP, 2; dense ones to DP x CP, 4), and rank 0's ZeRO-1 shard is the
    number of elements its optimizer steps."""
    built = built_buckets(runner.grad_buffer)
    planned = grad_buckets(config, rank_parameters(config, 0))
    problems = [] if built == planned else [f"buckets {built}, planned {planned}"]
    if rank == 0:
        owned = sum(s.main.numel() for s in runner.optimizer.segments)
        planned_owned = weights_and_optimizer(config, 0)["owned"]
        problems += [] if owned == planned_owned else [f"owned {owned}, planned {planned_owned}"]
    return problems


def test_resume_at_another_expert_parallel_size(tmp_path):
    failures = [f"rank {rank}, {name}: {problems}"
                for rank, result in enumerate(run_distributed(4, _resume, str(tmp_path),
                                                              timeout=300))
                for name, problems in result.items() if problems]
    assert not failures, "\n".join(failures)
