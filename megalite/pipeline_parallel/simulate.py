"""Run every rank's schedule together on a clock, without communication (docs/design.md §5).

Each rank executes its action list in order; an action starts when the rank's previous
action has finished and the action it depends on, on whichever rank, has finished. Sends
are free and asynchronous, so the only waiting is for data (`_dependencies`: on the
global stages s of `stages.Stage`, F needs F of s-1, B its F and B of s+1, W its B).
If every rank is waiting on an action no rank can run next, the schedules deadlock.

Costs: F a chunk's forward, B its input gradient and W its weight gradient. A schedule
that splits the backward (lists W actions) pays B for a backward and W for a W; one that
does not pays B+W for its whole backward. With the default W = 0, B is the whole backward.

Bubble (Narayanan et al. 2021, §2.2): every rank does the same work, m*v chunk forwards
and backwards (and weight-gradient passes), `busy` time units. A rank is idle for
`makespan - busy`, and the bubble fraction is idle / busy = t_pb / t_id. With chunk costs
F and B a whole microbatch costs t_f + t_b = v*(F+B) per rank, so the paper's
t_pb = (p-1)(t_f+t_b)/v and t_id = m(t_f+t_b) give (p-1)/(v*m), and (p-1)/m for v = 1.

Uneven stages (docs/design.md §15): `work_per_stage[s]` scales every cost of global
stage s (`stage_work` gives it from the layers per stage and the embedding's and loss's
weight in layers). Ranks then differ in work, and `idle_fraction`, all ranks' idle time over all
their work, is the bubble to compare: equal to `bubble_fraction` when the work is even.
"""

from dataclasses import dataclass
from fractions import Fraction

from megalite.pipeline_parallel.schedules import BACKWARD, FORWARD, WEIGHT, Action
from megalite.pipeline_parallel.stages import Stage


class DeadlockError(RuntimeError):
    """No rank can run its next action: the schedules wait on each other."""


@dataclass(frozen=True)
class Simulation:
    finish: dict      # (kind, microbatch, stage) -> finish time
    start: dict       # (kind, microbatch, stage) -> start time
    busy: int         # time the busiest rank spends computing (in the costs' type)
    makespan: int     # when the last rank finishes
    total_busy: int = 0  # time all ranks together spend computing
    num_ranks: int = 1

    @property
    def bubble_fraction(self) -> Fraction:
        # exact, so tests can compare with the closed form by equality
        return Fraction(self.makespan - self.busy) / Fraction(self.busy)

    @property
    def idle_fraction(self) -> Fraction:
        """All ranks' idle time over their work: the bubble of uneven stages."""
        return (Fraction(self.num_ranks * self.makespan - self.total_busy)
                / Fraction(self.total_busy))


def _dependencies(action: Action, stage: Stage) -> list[tuple]:
    s, mb = stage.index, action.microbatch
    if action.kind == FORWARD:
        return [] if stage.is_first else [(FORWARD, mb, s - 1)]
    if action.kind == WEIGHT:
        return [(BACKWARD, mb, s)]
    return [(FORWARD, mb, s)] + ([] if stage.is_last else [(BACKWARD, mb, s + 1)])


def stage_work(layer_counts, embedding: float = 0, loss: float = 0) -> list:
    """Each global stage's work in layers: its layers, plus the embedding's weight on the
    first stage and the output layer's and loss's on the last."""
    work = list(layer_counts)
    work[0] += embedding
    work[-1] += loss
    return work


def simulate(schedules: list[list[Action]], num_chunks: int = 1, forward_cost=1,
             backward_cost=2, weight_cost=0, work_per_stage=None) -> Simulation:
    """Execute `schedules[r]` on rank r for all r; raise DeadlockError if they get stuck.
    Costs may be ints or Fractions (exact) or floats (measured times); `work_per_stage[s]`,
    if given, multiplies the costs of global stage s (uneven stages)."""
    p = len(schedules)
    split = any(a.kind == WEIGHT for schedule in schedules for a in schedule)
    base = {FORWARD: forward_cost, WEIGHT: weight_cost,
            BACKWARD: backward_cost if split else backward_cost + weight_cost}

    finish, start_at, clock, nxt = {}, {}, [0] * p, [0] * p
    work = [0] * p
    while any(nxt[r] < len(schedules[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(schedules[r]):
                action = schedules[r][nxt[r]]
                stage = Stage(action.chunk, r, p, num_chunks)
                deps = _dependencies(action, stage)
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                cost = base[action.kind] * (1 if work_per_stage is None
                                            else work_per_stage[stage.index])
                clock[r] = start + cost
                work[r] += cost
                key = (action.kind, action.microbatch, stage.index)
                start_at[key], finish[key] = start, clock[r]
                nxt[r] += 1
                progressed = True
        if not progressed:
            blocked = {r: schedules[r][nxt[r]] for r in range(p) if nxt[r] < len(schedules[r])}
            raise DeadlockError(f"pipeline schedules deadlock; rank -> blocked action: {blocked}")
    return Simulation(finish=finish, start=start_at, busy=max(work), makespan=max(clock),
                      total_busy=sum(work), num_ranks=p)
