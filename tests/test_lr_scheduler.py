"""Each learning-rate schedule against its closed form at chosen iterations."""

import math

import pytest
import torch

from megalite.arguments import parse_args
from megalite.validation import validate_args
from megalite.optimizer.lr_scheduler import LRScheduler

from tests.helpers import BASE_FLAGS, without

# 100 iterations of global batch 8, lr 1.0 -> 0.1, 10 warm-up iterations.
MAX, MIN, WARM, TOTAL = 1.0, 0.1, 10, 100


def schedule(*extra):
    flags = without(BASE_FLAGS, "--train-iters", "--lr")
    cfg = validate_args(parse_args(flags + ["--train-iters", str(TOTAL), "--lr", str(MAX),
                                            "--min-lr", str(MIN), "--lr-warmup-iters",
                                            str(WARM), *extra]))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return LRScheduler(opt, cfg.scheduler), opt


def lr_at(scheduler, iteration):
    """Learning rate in effect after `iteration` optimizer steps of 8 samples."""
    scheduler.num_steps = 0
    scheduler.step(iteration * 8)
    return scheduler.lr


def warmup(i):
    return MAX * i / WARM


def decay_ratio(i):
    return (i - WARM) / (TOTAL - WARM)


@pytest.mark.parametrize("style, formula", [
    ("constant", lambda i: MAX),
    ("linear", lambda i: MIN + (MAX - MIN) * (1 - decay_ratio(i))),
    ("cosine", lambda i: MIN + (MAX - MIN) * 0.5 * (1 + math.cos(math.pi * decay_ratio(i)))),
])
def test_schedules_closed_form(style, formula):
    sched, opt = schedule("--lr-decay-style", style)
    for i in (0, 3, 10):
        assert lr_at(sched, i) == pytest.approx(warmup(i))
    for i in (11, 37, 55, 90, 100):
        assert lr_at(sched, i) == pytest.approx(formula(i))
        assert opt.param_groups[0]["lr"] == pytest.approx(formula(i))
    assert lr_at(sched, 150) == pytest.approx(MAX if style == "constant" else MIN)


@pytest.mark.parametrize("wsd_style, anneal", [
    ("linear", lambda r: 1 - r),
    ("cosine", lambda r: 0.5 * (1 + math.cos(math.pi * r))),
    ("exponential", lambda r: 2 * 0.5 ** r - 1),
    ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd_closed_form(wsd_style, anneal):
    """Warm-up, stable at max until the last 20 iterations, then anneal to min."""
    sched, _ = schedule("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20",
                        "--lr-wsd-decay-style", wsd_style)
    assert lr_at(sched, 5) == pytest.approx(warmup(5))
    for i in (11, 50, 80):
        assert lr_at(sched, i) == pytest.approx(MAX)
    for i in (81, 90, 95, 100):
        assert lr_at(sched, i) == pytest.approx(MIN + (MAX - MIN) * anneal((i - 80) / 20))


def test_state_round_trip():
    sched, opt = schedule("--lr-decay-style", "cosine")
    sched.step(8 * 42)
    other, other_opt = schedule("--lr-decay-style", "cosine")
    other.load_state_dict(sched.state_dict())
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
