"""The ranks of pretrain_gpt.py as Ray actors, restarted as a group when one is lost
(issue 45; tools/ray_launch.py is its command line, examples/ray/ a cluster's setup).

Each round: a placement group of one bundle per rank (SPREAD by default, so a lost node
takes as few ranks as it can), one `Rank` actor in each, rank 0's node and a free port as
the rendezvous (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and
`run_pretrain` in every actor. A rank is lost when its process or its node dies (Ray raises
on its result), when it exits non-zero, or when a signal stopped the run early
(--exit-signal-handler: a preemption notice's SIGTERM saved and exited 0). Then the whole
group is killed (a survivor would wait forever in a collective) and a new round starts, up
to --max-failures times, Ray Train's FailureConfig(max_failures); the flags' --load resumes
it from the newest checkpoint. A bad flag (exit status 2) is not retried.

Plain actors rather than Ray Train's TorchTrainer (docs/design.md §29): TorchTrainer runs
the training function in a thread of its worker, where Python cannot install the signal
handlers --exit-signal-handler needs; an actor's method runs on its process's main thread.
And a rank here is a torchrun rank in every way megalite can see, with megalite's own
rendezvous and checkpoints, where TorchTrainer brings its own process group, checkpoint
and reporting API, and Ray Train's dependencies.
"""

import os
import sys
import time
from dataclasses import dataclass

from megalite.arguments import parse_args
from megalite.errors import ConfigError, MegaliteError
from megalite.network import free_port

LOG_GRACE_S = 2.0
"""Ray forwards the ranks' output from their log files every few hundred milliseconds: a
driver that left at once could lose the last lines."""


def import_ray():
    # Every rank's lines, not "[repeated 2x across cluster]" (read when ray is imported).
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray
    except ImportError:
        raise MegaliteError("the Ray launch needs Ray: pip install 'megalite[ray]'") from None
    return ray


class Rank:
    """One rank of pretrain_gpt.py in a Ray actor (the class is made remote at launch)."""

    def where(self) -> tuple[str, int, int]:
        """(this node's address, a free port on it, this process's pid)."""
        ray = import_ray()
        return ray.util.get_node_ip_address(), free_port(), os.getpid()

    def run(self, argv: list[str], env: dict[str, str], cwd: str) -> tuple[int, bool]:
        """pretrain_gpt.py's exit status, and whether a signal stopped it early."""
        os.environ.update(env)
        if os.path.isdir(cwd):  # the driver's directory, where relative paths point
            os.chdir(cwd)
        from megalite.training import run_pretrain  # the rank's: the driver needs none of it
        outcome = run_pretrain(argv)
        sys.stdout.flush()
        return outcome.exit_code, outcome.signalled


@dataclass(frozen=True)
class Launch:
    """The launcher's flags (tools/ray_launch.py)."""
    num_workers: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    strategy: str = "SPREAD"
    max_failures: int = 3
    placement_timeout_s: float = 600.0


def check_resumable(argv: list[str]) -> None:
    """A restarted group must resume: --save and --load the same directory."""
    args = parse_args(argv)
    if args.save is None or args.load != args.save:
        raise ConfigError(f"the Ray launch restarts lost workers from the newest checkpoint: "
                          f"give --save DIR and --load DIR, the same directory (got --save "
                          f"{args.save}, --load {args.load})")


def launch(argv: list[str], settings: Launch, address: str | None = None) -> int:
    """Run pretrain_gpt.py with `argv` on Ray until it finishes; its exit status."""
    check_resumable(argv)
    ray = import_ray()
    ray.init(address=address)
    failures = 0  # also the round's number
    limit = settings.max_failures if settings.max_failures >= 0 else "no limit"
    try:
        while True:
            status, why = run_round(ray, argv, settings, failures)
            if why is None:
                return status
            failures += 1
            if 0 <= settings.max_failures < failures:
                print(f"ray launch: {why}; --max-failures {settings.max_failures} used up",
                      flush=True)
                return 1
            print(f"ray launch: {why}; restarting the group from the newest checkpoint "
                  f"(failure {failures} of {limit})", flush=True)
    finally:
        time.sleep(LOG_GRACE_S)
        ray.shutdown()


def run_round(ray, argv: list[str], settings: Launch, round_: int) -> tuple[int, str | None]:
    """One group from start to end: (its exit status, why it must be restarted or None)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    bundle = {"CPU": settings.cpus_per_worker}
    if settings.gpus_per_worker:
        bundle["GPU"] = settings.gpus_per_worker
    group = placement_group([bundle] * settings.num_workers, strategy=settings.strategy)
    actors = []
    try:
        try:
            ray.get(group.ready(), timeout=settings.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise MegaliteError(f"ray launch: no room for {settings.num_workers} workers of "
                                f"{bundle} ({settings.strategy}) within --placement-timeout "
                                f"{settings.placement_timeout_s:g} s") from None
        rank = ray.remote(Rank)
        actors = [rank.options(num_cpus=settings.cpus_per_worker,
                               num_gpus=settings.gpus_per_worker,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   group, placement_group_bundle_index=i)).remote()
                  for i in range(settings.num_workers)]
        try:
            places = ray.get([a.where.remote() for a in actors])
        except ray.exceptions.RayError as e:
            return 1, f"a worker was lost while starting ({type(e).__name__})"
        return _train(ray, actors, places, argv, round_)
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _train(ray, actors, places, argv: list[str], round_: int) -> tuple[int, str | None]:
    # Ranks by node, in the order the nodes first appear: consecutive ranks (a TP group)
    # share a node whatever the placement strategy did with the bundles.
    nodes = list(dict.fromkeys(node for node, _, _ in places))
    order = sorted(range(len(actors)), key=lambda i: (nodes.index(places[i][0]), i))
    master, port, _ = places[order[0]]
    env = dict(MASTER_ADDR=master, MASTER_PORT=str(port), WORLD_SIZE=str(len(actors)),
               LOCAL_RANK="0")  # Ray gives each actor its own CUDA_VISIBLE_DEVICES
    pending = {}
    for r, i in enumerate(order):
        node, _, pid = places[i]
        print(f"ray launch round {round_}: rank {r} pid {pid} on {node}", flush=True)
        pending[actors[i].run.remote(argv, {**env, "RANK": str(r)}, os.getcwd())] = r
    signalled = False
    while pending:
        (done,), _ = ray.wait(list(pending), num_returns=1)
        r = pending.pop(done)
        try:
            status, stopped = ray.get(done)
        except ray.exceptions.RayError as e:
            return 1, f"rank {r} was lost ({type(e).__name__})"
        if status != 0:
            return status, None if status == 2 else f"rank {r} exited with status {status}"
        signalled |= stopped
    return 0, "a signal stopped training before its last iteration" if signalled else None
