"""Pipeline schedules without communication (docs/design.md §5, issue 5).

Every schedule is checked for coverage (each microbatch-chunk forward once, backward once,
backward after forward), against orders written out by hand from the paper's rules, and
run on all ranks together by the simulator, whose bubble must equal Narayanan et al.'s
closed form exactly: (p-1)/m for 1F1B, (p-1)/(v*m) interleaved.
"""

from collections import Counter
from fractions import Fraction

import pytest

from megalite.errors import ConfigError
from megalite.pipeline_parallel.schedules import (
    Action, build_schedule, forward_only, interleaved_one_f_one_b, no_pipelining,
    one_f_one_b, validate_schedule_args, warmup_microbatches)
from megalite.pipeline_parallel.simulate import DeadlockError, simulate

# (p, m, v): 1F1B for every m up to 4p (m < p included), interleaved for m a multiple of p.
GRID = [(p, m, 1) for p in range(1, 9) for m in range(1, 4 * p + 1)] + \
       [(p, m, v) for p in range(2, 9) for v in range(2, 5) for m in range(p, 4 * p + 1, p)]


def _ids(grid):
    return [f"p{p}-m{m}-v{v}" for p, m, v in grid]


def parse(text: str) -> list[Action]:
    """'F0a B0a F1b' -> actions; the letter is the chunk (a = 0, b = 1, ...)."""
    kinds = {"F": "forward", "B": "backward"}
    return [Action(kinds[t[0]], int(t[1:-1]), ord(t[-1]) - ord("a")) for t in text.split()]


def all_ranks(p, m, v):
    return [build_schedule(p, r, m, v) for r in range(p)]


# --- orders written out by hand --------------------------------------------------------

def test_no_pipelining_is_gradient_accumulation():
    assert no_pipelining(3) == parse("F0a B0a F1a B1a F2a B2a")
    assert build_schedule(1, 0, 3) == no_pipelining(3)


@pytest.mark.parametrize("rank, expected", [
    # warmup p-r-1 forwards, then F/B pairs, then the remaining backwards (paper Fig. 4 top)
    (0, "F0a F1a F2a F3a B0a F4a B1a F5a B2a F6a B3a F7a B4a B5a B6a B7a"),
    (2, "F0a F1a B0a F2a B1a F3a B2a F4a B3a F5a B4a F6a B5a F7a B6a B7a"),
    (3, "F0a B0a F1a B1a F2a B2a F3a B3a F4a B4a F5a B5a F6a B6a F7a B7a"),
])
def test_one_f_one_b_order(rank, expected):
    assert one_f_one_b(4, rank, 8) == parse(expected)


def test_one_f_one_b_fewer_microbatches_than_stages():
    # m < p: warmup is capped at m, so rank 0 runs all forwards then all backwards.
    assert one_f_one_b(4, 0, 2) == parse("F0a F1a B0a B1a")


@pytest.mark.parametrize("rank, expected", [
    # p=4, v=2, m=8: forwards p microbatches per chunk, chunk a then b; backwards chunk b
    # then a; warmup 2*(p-r-1) + (v-1)*p = 10 on rank 0, 4 on rank 3.
    (0, "F0a F1a F2a F3a F0b F1b F2b F3b F4a F5a F6a B0b F7a B1b F4b B2b F5b B3b "
        "F6b B0a F7b B1a B2a B3a B4b B5b B6b B7b B4a B5a B6a B7a"),
    (3, "F0a F1a F2a F3a F0b B0b F1b B1b F2b B2b F3b B3b F4a B0a F5a B1a F6a B2a "
        "F7a B3a F4b B4b F5b B5b F6b B6b F7b B7b B4a B5a B6a B7a"),
])
def test_interleaved_order(rank, expected):
    assert interleaved_one_f_one_b(4, rank, 8, 2) == parse(expected)


def test_interleaved_with_m_equal_p_runs_all_forwards_first():
    assert interleaved_one_f_one_b(2, 1, 2, 2) == parse("F0a F1a F0b F1b B0b B1b B0a B1a")


def test_build_schedule_dispatch():
    assert build_schedule(4, 1, 8) == one_f_one_b(4, 1, 8)
    assert build_schedule(4, 1, 8, 3) == interleaved_one_f_one_b(4, 1, 8, 3)
    assert interleaved_one_f_one_b(4, 1, 8, 1) == one_f_one_b(4, 1, 8)


# --- coverage, warmup and memory over the grid -----------------------------------------

@pytest.mark.parametrize("p, m, v", GRID, ids=_ids(GRID))
def test_each_microbatch_chunk_forward_once_then_backward_once(p, m, v):
    expected = {(i, c) for i in range(m) for c in range(v)}
    for rank in range(p):
        schedule = build_schedule(p, rank, m, v)
        position = {}
        for i, a in enumerate(schedule):
            key = (a.kind, a.microbatch, a.chunk)
            assert key not in position, f"rank {rank} runs {key} twice"
            position[key] = i
        for kind in ("forward", "backward"):
            assert {(i, c) for k, i, c in position if k == kind} == expected
        for i, c in expected:
            assert position[("forward", i, c)] < position[("backward", i, c)]


def test_warmup_formula_values():
    # 1F1B: min(p-r-1, m)
    assert [warmup_microbatches(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert warmup_microbatches(4, 0, 2) == 2
    # interleaved: 2*(p-r-1) + (v-1)*p, capped at m*v; m == p -> all m*v forwards first
    assert [warmup_microbatches(4, r, 8, 2) for r in range(4)] == [10, 8, 6, 4]
    assert warmup_microbatches(4, 0, 8, 4) == 6 + 12
    assert warmup_microbatches(2, 0, 4, 4) == 2 + 6
    assert warmup_microbatches(4, 3, 4, 2) == 8
    assert warmup_microbatches(8, 0, 16, 2) == 14 + 8


@pytest.mark.parametrize("p, m, v", GRID, ids=_ids(GRID))
def test_forwards_before_first_backward_are_warmup_plus_one(p, m, v):
    # Warmup forwards, then the steady state opens with one more forward before its backward.
    for rank in range(p):
        schedule = build_schedule(p, rank, m, v)
        leading = next(i for i, a in enumerate(schedule) if a.kind == "backward")
        assert leading == min(warmup_microbatches(p, rank, m, v) + 1, m * v)


def _peak_in_flight(schedule):
    live = peak = 0
    for a in schedule:
        live += 1 if a.kind == "forward" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p, m", [(p, m) for p, m, v in GRID if v == 1])
def test_one_f_one_b_keeps_at_most_p_minus_r_microbatches(p, m):
    # The memory point of 1F1B over GPipe: rank r stashes p-r activations, not m.
    for rank in range(p):
        assert _peak_in_flight(one_f_one_b(p, rank, m)) == min(p - rank, m) <= p


# --- the simulator: all ranks together -------------------------------------------------

def test_simulator_by_hand_two_stages():
    # rank 0: F0 0-1, F1 1-2, B0 4-6 (waits for rank 1's B0), B1 7-9
    # rank 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7
    sim = simulate(all_ranks(2, 2, 1))
    assert sim.finish[("backward", 0, 0)] == 6
    assert sim.makespan == 9 and sim.busy == 6
    assert sim.bubble_fraction == Fraction(1, 2)


def test_simulator_detects_deadlock():
    # Rank 0's B0 waits for rank 1's B0, which comes after rank 1's F1, which waits for
    # rank 0's F1, which comes after rank 0's B0.
    with pytest.raises(DeadlockError, match="blocked"):
        simulate([parse("F0a B0a F1a B1a"), parse("F1a B1a F0a B0a")])
    # A backward listed before its own forward can never run.
    with pytest.raises(DeadlockError):
        simulate([parse("B0a F0a")])


@pytest.mark.parametrize("p, m, v", GRID, ids=_ids(GRID))
def test_bubble_equals_paper_formula(p, m, v):
    sim = simulate(all_ranks(p, m, v), num_chunks=v, forward_cost=1, backward_cost=2)
    assert sim.busy == m * v * 3
    assert sim.bubble_fraction == Fraction(p - 1, v * m)


@pytest.mark.parametrize("forward_cost, backward_cost", [(1, 1), (1, 3), (3, 2)])
def test_bubble_formula_holds_for_other_cost_ratios(forward_cost, backward_cost):
    for p, m, v in GRID[::7]:
        sim = simulate(all_ranks(p, m, v), v, forward_cost, backward_cost)
        assert sim.bubble_fraction == Fraction(p - 1, v * m), (p, m, v)


def test_bubble_measure_sees_a_pipeline_drained_per_microbatch():
    # The measure is not trivially the formula: running each microbatch through the whole
    # pipeline and back before the next (F B on every rank) pays fill and drain m times.
    p, m = 4, 8
    naive = [[a for i in range(m) for a in parse(f"F{i}a B{i}a")] for _ in range(p)]
    assert simulate(naive).bubble_fraction == Fraction(p - 1, 1)


# --- evaluation ------------------------------------------------------------------------

@pytest.mark.parametrize("p, m, v", GRID, ids=_ids(GRID))
def test_forward_only_covers_every_microbatch_chunk_once(p, m, v):
    schedules = [forward_only(p, r, m, v) for r in range(p)]
    for rank, schedule in enumerate(schedules):
        assert Counter((a.microbatch, a.chunk) for a in schedule) == \
            Counter((i, c) for i in range(m) for c in range(v))
        assert all(a.kind == "forward" for a in schedule)
        training = [a for a in build_schedule(p, rank, m, v) if a.kind == "forward"]
        assert schedule == training
    assert simulate(schedules, num_chunks=v).makespan >= m * v


# --- user input ------------------------------------------------------------------------

def test_interleaving_needs_m_multiple_of_p():
    with pytest.raises(ConfigError) as err:
        validate_schedule_args(4, 6, 2)
    message = str(err.value)
    for flag in ("--global-batch-size", "--micro-batch-size", "--pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage", "m=6"):
        assert flag in message
    with pytest.raises(ConfigError):
        build_schedule(4, 0, 6, 2)
    with pytest.raises(ConfigError):
        forward_only(4, 0, 6, 2)
    validate_schedule_args(4, 6, 1)  # 1F1B takes any m


@pytest.mark.parametrize("p, m, v, flag", [
    (0, 4, 1, "--pipeline-model-parallel-size"),
    (2, 0, 1, "--global-batch-size"),
    (2, 4, 0, "--num-layers-per-virtual-pipeline-stage"),
    (1, 4, 2, "--pipeline-model-parallel-size"),
])
def test_invalid_schedule_args_name_the_flag(p, m, v, flag):
    with pytest.raises(ConfigError, match=flag):
        validate_schedule_args(p, m, v)
