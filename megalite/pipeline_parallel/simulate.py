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
    busy: int         # time each rank spends computing (in the costs' type)
    makespan: int     # when the last rank finishes

    @property
    def bubble_fraction(self) -> Fraction:
        # exact, so tests can compare with the closed form by equality
        return Fraction(self.makespan - self.busy) / Fraction(self.busy)


def _dependencies(action: Action, stage: Stage) -> list[tuple]:
    s, mb = stage.index, action.microbatch
    if action.kind == FORWARD:
        return [] if stage.is_first else [(FORWARD, mb, s - 1)]
    if action.kind == WEIGHT:
        return [(BACKWARD, mb, s)]
    return [(FORWARD, mb, s)] + ([] if stage.is_last else [(BACKWARD, mb, s + 1)])


def simulate(schedules: list[list[Action]], num_chunks: int = 1, forward_cost=1,
             backward_cost=2, weight_cost=0) -> Simulation:
    """Execute `schedules[r]` on rank r for all r; raise DeadlockError if they get stuck.
    Costs may be ints or Fractions (exact) or floats (measured times)."""
    p = len(schedules)
    split = any(a.kind == WEIGHT for schedule in schedules for a in schedule)
    cost = {FORWARD: forward_cost, WEIGHT: weight_cost,
            BACKWARD: backward_cost if split else backward_cost + weight_cost}
    finish, start_at, clock, nxt = {}, {}, [0] * p, [0] * p
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
                clock[r] = start + cost[action.kind]
                key = (action.kind, action.microbatch, stage.index)
                start_at[key], finish[key] = start, clock[r]
                nxt[r] += 1
                progressed = True
        if not progressed:
            blocked = {r: schedules[r][nxt[r]] for r in range(p) if nxt[r] < len(schedules[r])}
            raise DeadlockError(f"pipeline schedules deadlock; rank -> blocked action: {blocked}")
    busy = max(sum(cost[a.kind] for a in schedule) for schedule in schedules)
    return Simulation(finish=finish, start=start_at, busy=busy, makespan=max(clock))
