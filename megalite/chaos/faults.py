"""The kinds of fault a campaign injects, and its seeded schedule of runs.

A kind is injected one of three ways:
  hook     in a rank, at a phase of a step, a save or a load (inject.py);
  signal   from outside, to a rank, the agent or the whole job, a random moment after an
           iteration's log line (SIGKILL, SIGTERM/SIGUSR1 with --exit-signal-handler,
           SIGSTOP for a hung rank);
  between  to the files, after a SIGKILL of a random rank and before the restart loads
           (a checkpoint file or the tracker corrupted, truncated or deleted; a bit of a
           rank's non-persistent local checkpoint flipped; the dataset's .bin or .idx
           truncated).
`recovers`: the restart policy alone must end the run bit-identical to the fault-free one.
Otherwise the job must stop with an error naming the fault, and the fix docs/
troubleshooting.md gives (campaign.py applies it) must then end it bit-identical.
`names`: an error naming the fault (rank, file, iteration) must be printed on the way.
"""

import random
from dataclasses import dataclass, field

POLICIES = ("restarts", "elastic", "requeue")
"""torchrun --max-restarts; two elastic agents (c10d rendezvous on a store of their own)
of which a lost one is replaced; a Slurm-style requeue (torchrun without restarts, the
same command run again)."""


@dataclass(frozen=True)
class Kind:
    name: str
    group: str
    how: str  # "hook" | "signal" | "between"
    where: str = ""  # the hook's point (inject.py), the signal's target, the file hit
    recovers: bool = True
    names: bool = False
    mode: str | None = None  # the saves the run needs: "sync", "async" or "local"
    occurrences: int = 1  # the hook fires at one of the first this many calls
    rank0: bool = False  # a point only rank 0 reaches


KINDS = [
    Kind("kill_forward", "SIGKILL in a step", "hook", "forward", occurrences=2),
    Kind("kill_backward", "SIGKILL in a step", "hook", "backward", occurrences=2),
    Kind("kill_grad_reduce", "SIGKILL in a step", "hook", "grad_reduce"),
    Kind("kill_optimizer", "SIGKILL in a step", "hook", "optimizer"),
    Kind("kill_sync_save", "SIGKILL in a save", "hook", "save_sync", mode="sync",
         occurrences=2),
    Kind("kill_async_write", "SIGKILL in a save", "hook", "save_async", mode="async",
         occurrences=2),
    Kind("kill_local_save", "SIGKILL in a save", "hook", "save_local", mode="local"),
    Kind("kill_publish", "SIGKILL in a save", "hook", "publish", rank0=True),
    Kind("kill_tracker", "SIGKILL in a save", "hook", "tracker", rank0=True),
    Kind("kill_load", "SIGKILL in a load", "hook", "load", occurrences=2),
    Kind("kill_rank", "SIGKILL of a rank or agent", "signal", "rank"),
    Kind("kill_agent", "SIGKILL of a rank or agent", "signal", "agent"),
    Kind("sigterm_job", "graceful signal", "signal", "job"),
    Kind("sigusr1_rank", "graceful signal", "signal", "rank"),
    Kind("hang_rank", "hung rank (SIGSTOP)", "signal", "rank"),
    Kind("corrupt_file", "checkpoint file or tracker", "between", "file", False, True),
    Kind("truncate_file", "checkpoint file or tracker", "between", "file", False, True),
    Kind("delete_file", "checkpoint file or tracker", "between", "file", False, True),
    Kind("corrupt_local", "checkpoint file or tracker", "between", "local", mode="local"),
    Kind("garble_tracker", "checkpoint file or tracker", "between", "tracker", False, True),
    Kind("delete_tracker", "checkpoint file or tracker", "between", "tracker", False, True),
    Kind("disk_full", "full disk in a save", "hook", "disk_full", names=True),
    Kind("truncate_bin", "truncated dataset", "between", "bin", False, True),
    Kind("truncate_idx", "truncated dataset", "between", "idx", False, True),
    Kind("nan_grad", "NaN in a gradient", "hook", "nan", names=True),
]
BY_NAME = {kind.name: kind for kind in KINDS}
SIGNALS = {"kill_rank": "SIGKILL", "kill_agent": "SIGKILL", "sigterm_job": "SIGTERM",
           "sigusr1_rank": "SIGUSR1", "hang_rank": "SIGSTOP"}


@dataclass
class Fault:
    id: int
    kind: Kind
    rank: int
    after: int  # iterations after the resume before it is armed (1..)
    occurrence: int
    delay_s: float  # a signal's delay after the iteration's log line
    pick: float  # which file / byte / gradient element, as a fraction


# A kind's `mode` as the run's setting it needs: (attribute, value).
SAVES = {"sync": ("async_save", False), "async": ("async_save", True), "local": ("local", True)}


@dataclass
class RunPlan:
    index: int
    policy: str
    async_save: bool | None = None  # --async-save
    local: bool | None = None  # non-persistent local saves as well
    faults: list[Fault] = field(default_factory=list)

    def fits(self, kind: Kind, per_run: int) -> bool:
        wants = SAVES.get(kind.mode)
        return len(self.faults) < per_run and (
            wants is None or getattr(self, wants[0]) in (None, wants[1]))

    def add(self, fault: Fault) -> None:
        wants = SAVES.get(fault.kind.mode)
        if wants is not None:
            setattr(self, *wants)
        self.faults.append(fault)


def schedule(seed: int, n_faults: int, per_run: int, kinds: list[Kind] = KINDS,
             policies: tuple[str, ...] = POLICIES) -> list[RunPlan]:
    """`n_faults` faults, the kinds dealt as shuffled decks (every kind once before any
    twice), `per_run` to a run whose saves suit them all; the policies taken in turn."""
    rng = random.Random(seed)
    order = []
    while len(order) < n_faults:
        order += rng.sample(kinds, len(kinds))
    runs: list[RunPlan] = []
    for i, kind in enumerate(order[:n_faults]):
        run = next((r for r in runs if r.fits(kind, per_run)), None)
        if run is None:
            run = RunPlan(len(runs), policies[len(runs) % len(policies)])
            runs.append(run)
        run.add(Fault(i, kind, 0 if kind.rank0 else rng.randrange(2), rng.randint(1, 6),
                      rng.randint(1, kind.occurrences), round(rng.uniform(0.0, 0.05), 4),
                      rng.random()))
    for run in runs:
        run.async_save = rng.random() < 0.5 if run.async_save is None else run.async_save
        run.local = rng.random() < 0.5 if run.local is None else run.local
    return runs
