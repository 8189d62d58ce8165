"""GPipe and ZB-H1 (issue 16): coverage, orders written out by hand, memory, and the
simulated bubble against the closed forms.

Closed forms, with F, B, W the times of a chunk's forward, input-gradient and
weight-gradient passes and idle = makespan - busy per rank, busy = m(F+B+W):
- GPipe (Huang et al. 2019) and 1F1B: idle (p-1)(F+B+W), bubble (p-1)/m;
- ZB-H1 (Qi et al. 2024, §3.1): idle (p-1)(F+B-W) for m >= p whenever W <= F and W <= B,
  a third of 1F1B's at F = B = W. With fewer microbatches than stages only the m-1 later
  microbatches' Ws can fill the wait for the first B: idle (p-1)(F+B) - (m-1)W.
"""

from fractions import Fraction

import pytest

from megalite.errors import ConfigError
from megalite.pipeline_parallel.schedules import (
    Action, build_schedule, forward_only, gpipe, one_f_one_b, validate_schedule_args, zb_h1)
from megalite.pipeline_parallel.simulate import simulate

GRID = [(p, m) for p in range(1, 9) for m in range(1, 4 * p + 1)]
SPLIT = {"gpipe": False, "zb-h1": True, "1f1b": False}
COSTS = [(1, 1, 1), (2, 2, 1), (3, 2, 1), (2, 3, 2), (3, 3, 3), (4, 3, 2), (5, 4, 4)]


def parse(text: str) -> list[Action]:
    """'F0 B0 W0' -> actions on chunk 0."""
    kinds = {"F": "forward", "B": "backward", "W": "weight"}
    return [Action(kinds[t[0]], int(t[1:]), 0) for t in text.split()]


def all_ranks(p, m, schedule):
    return [build_schedule(p, r, m, 1, schedule) for r in range(p)]


def test_gpipe_order():
    assert gpipe(4, 2, 3) == parse("F0 F1 F2 B0 B1 B2")


@pytest.mark.parametrize("rank, expected", [
    # Rank r: 1F1B's order, each B followed by the W r microbatches older; rank 0 defers
    # none, the last rank p-1 = 3; the deferred Ws end the schedule.
    (0, "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"),
    (1, "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7"),
    (3, "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"),
])
def test_zb_h1_order(rank, expected):
    assert zb_h1(4, rank, 8) == parse(expected)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
@pytest.mark.parametrize("p, m", GRID)
def test_each_microbatch_once_in_dependency_order(schedule, p, m):
    kinds = ("forward", "backward", "weight") if SPLIT[schedule] and p > 1 else \
        ("forward", "backward")
    for rank in range(p):
        actions = build_schedule(p, rank, m, 1, schedule)
        position = {}
        for i, a in enumerate(actions):
            key = (a.kind, a.microbatch, a.chunk)
            assert key not in position, f"rank {rank} runs {key} twice"
            position[key] = i
        assert set(position) == {(k, i, 0) for k in kinds for i in range(m)}
        for i in range(m):
            assert position[("forward", i, 0)] < position[("backward", i, 0)]
            if "weight" in kinds:
                assert position[("backward", i, 0)] < position[("weight", i, 0)]
        # Forwards in the same order as every schedule's, so evaluation is shared.
        assert [a for a in actions if a.kind == "forward"] == forward_only(p, rank, m)


def _peak_in_flight(actions):
    """Microbatches whose activations are alive: from F to the end of their backward (W
    when the backward is split: B keeps the layers' inputs and output gradients for W)."""
    split = any(a.kind == "weight" for a in actions)
    done = "weight" if split else "backward"
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "forward" else -1 if a.kind == done else 0
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p, m", GRID)
def test_peak_in_flight(p, m):
    # GPipe keeps all m; ZB-H1 at most p on every rank, p on rank 0 as 1F1B.
    assert _peak_in_flight(gpipe(p, 0, m) if p > 1 else build_schedule(p, 0, m)) == \
        (m if p > 1 else 1)
    for rank in range(p):
        zb = build_schedule(p, rank, m, 1, "zb-h1")
        assert _peak_in_flight(zb) <= min(p, m)
    assert _peak_in_flight(build_schedule(p, 0, m, 1, "zb-h1")) == \
        _peak_in_flight(one_f_one_b(p, 0, m) if p > 1 else build_schedule(p, 0, m)) == \
        min(p, m)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in GRID if p > 1])
def test_bubble_equals_closed_form(p, m):
    for F, B, W in COSTS:
        busy = m * (F + B + W)
        for schedule in ("gpipe", "1f1b"):
            sim = simulate(all_ranks(p, m, schedule), 1, F, B, W)
            assert sim.busy == busy
            assert sim.bubble_fraction == Fraction(p - 1, m), (schedule, F, B, W)
        sim = simulate(all_ranks(p, m, "zb-h1"), 1, F, B, W)
        assert sim.busy == busy
        idle = (p - 1) * (F + B) - (min(m, p) - 1) * W
        assert sim.bubble_fraction == Fraction(idle, busy), (F, B, W)
        if m >= p:
            assert sim.bubble_fraction == Fraction((p - 1) * (F + B - W), m * (F + B + W))


def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_costs():
    for p, m in [(4, 8), (8, 8), (8, 32)]:
        zb = simulate(all_ranks(p, m, "zb-h1"), 1, 1, 1, 1).bubble_fraction
        assert zb == Fraction(p - 1, m) / 3


def test_closed_form_needs_w_at_most_f_and_b():
    # With W larger the idle time is bounded by F, not F+B-W: the formula is only claimed
    # (and tested) where it holds.
    p, m, F, B, W = 4, 8, 1, 1, 2
    sim = simulate(all_ranks(p, m, "zb-h1"), 1, F, B, W)
    assert sim.bubble_fraction > Fraction((p - 1) * (F + B - W), m * (F + B + W))


def test_without_pipelining_nothing_is_split():
    for schedule in ("gpipe", "zb-h1"):
        assert build_schedule(1, 0, 3, 1, schedule) == build_schedule(1, 0, 3)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_interleaving_is_refused(schedule):
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage"):
        validate_schedule_args(4, 8, 2, schedule)
    with pytest.raises(ConfigError, match=schedule):
        build_schedule(4, 0, 8, 2, schedule)


def test_unknown_schedule_names_the_flag():
    with pytest.raises(ConfigError, match="--pipeline-schedule"):
        validate_schedule_args(2, 4, 1, "zb-v")


# --- the flag --------------------------------------------------------------------------

def _config(*extra, world_size=2):
    from megalite.arguments import parse_args
    from megalite.validation import validate_args
    from tests.helpers import BASE_FLAGS
    return validate_args(parse_args(BASE_FLAGS + list(extra)), world_size)


def test_pipeline_schedule_flag_reaches_the_config():
    assert _config().parallel.pipeline_schedule == "1f1b"
    config = _config("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1")
    assert config.parallel.pipeline_schedule == "zb-h1"


def test_pipeline_schedule_flag_refuses_interleaving():
    with pytest.raises(ConfigError, match="--pipeline-schedule gpipe"):
        _config("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe",
                "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                "--global-batch-size", "16")


def test_zb_h1_refuses_compiled_layers():
    # torch.compile traces a layer's backward whole, so its dW would come in B (checked:
    # with the aot_eager backend only the uncompiled output layer deferred its gradient).
    with pytest.raises(ConfigError, match="--compile-layers"):
        _config("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                "--compile-layers")
    _config("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe",
            "--compile-layers")


def test_help_says_what_each_schedule_costs():
    from megalite.arguments import build_parser
    text = " ".join(build_parser().format_help().split())
    for phrase in ("(p-1)/m", "(p-1)(F+B-W)/(m(F+B+W))", "activations of all m",
                   "beyond Megatron-LM"):
        assert phrase in text


def test_memory_estimate_follows_the_schedule():
    from megalite.memory_estimate.schedule import microbatches_in_flight
    assert microbatches_in_flight(4, 0, 8, 1, "gpipe") == 8
    assert [microbatches_in_flight(4, r, 8, 1, "zb-h1") for r in range(4)] == [4, 4, 4, 4]
    assert [microbatches_in_flight(4, r, 8, 1, "1f1b") for r in range(4)] == [4, 3, 2, 1]
