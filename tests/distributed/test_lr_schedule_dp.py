"""The learning rate megalite logs under data parallelism without --global-batch-size
(issue 12: the schedule once decayed over micro-batch samples, ending DP times early).

One launch per DP size runs pretrain's training loop once per decay style and compares
each logged `learning rate` with the schedule's closed form, written here in iterations
(and, for --train-samples, in samples of the Megatron default global batch, micro-batch x
DP). As in Megatron, iteration i logs the rate after i scheduler steps: the one iteration
i + 1 uses.
"""

import contextlib
import io
import math

import pytest
import torch

from megalite.arguments import parse_args
from megalite.parallel_state import ParallelState
from megalite.spawn import run_distributed
from megalite.training import run_training
from megalite.training_log import parse_log
from megalite.validation import validate_args

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # every test here launches processes

MAX, MIN, ITERS, MICRO = 1e-3, 1e-4, 20, 2
# The command, less the launcher's flags; no --global-batch-size.
TINY = flags_with("--max-position-embeddings", "16", "--log-interval", "1", "--eval-iters",
                  "0", "--num-workers", "0", vocab_size=128, make_vocab_size_divisible_by=None,
                  num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                  micro_batch_size=MICRO, global_batch_size=None, train_iters=None, lr=MAX)


def warmup_then(decay, warmup: int):
    """Linear warm-up from 0 over `warmup` iterations, then `decay(i)`."""
    return lambda i: MAX * i / warmup if i <= warmup else decay(i)


def ratio(i, start, end):
    return min(max((i - start) / (end - start), 0.0), 1.0)


def linear(i, start=0, end=ITERS, low=0.0):
    return low + (MAX - low) * (1 - ratio(i, start, end))


def cosine(i, start, end, low=MIN):
    return low + (MAX - low) * 0.5 * (1 + math.cos(math.pi * ratio(i, start, end)))


def case_flags(dp: int) -> dict:
    """name -> (flags, closed form of the lr logged at iteration i)."""
    g = MICRO * dp  # Megatron's global batch when --global-batch-size is unset
    samples = ITERS * g + g // 2  # 20 iterations; the decay runs half a batch longer
    iters = ["--train-iters", str(ITERS)]
    return {
        # The run: iteration 10 must log 1e-3 x (1 - 10/20) = 5.0E-04.
        "linear": (iters + ["--min-lr", "0", "--lr-decay-style", "linear"], linear),
        "cosine": (iters + ["--min-lr", str(MIN), "--lr-decay-style", "cosine",
                            "--lr-warmup-iters", "4"],
                   warmup_then(lambda i: cosine(i, 4, ITERS), 4)),
        "constant": (iters + ["--lr-decay-style", "constant", "--lr-warmup-iters", "4"],
                     warmup_then(lambda i: MAX, 4)),
        # Stable at --lr until the last 8 iterations, then a cosine anneal to --min-lr.
        "WSD": (iters + ["--min-lr", str(MIN), "--lr-decay-style", "WSD",
                         "--lr-wsd-decay-iters", "8", "--lr-wsd-decay-style", "cosine",
                         "--lr-warmup-iters", "2"],
                warmup_then(lambda i: cosine(i, ITERS - 8, ITERS), 2)),
        # In samples: warm-up over 3 global batches, linear decay to --min-lr at
        # --train-samples.
        "train-samples": (["--train-samples", str(samples), "--min-lr", str(MIN),
                           "--lr-warmup-samples", str(3 * g)],
                          lambda i: (MAX * i / 3 if i <= 3 else
                                     MIN + (MAX - MIN) * (1 - (i * g - 3 * g)
                                                          / (samples - 3 * g)))),
    }


def _logged_rates(rank: int, world_size: int) -> dict:
    """Each case's logged (iteration, learning rate, global batch), from the last rank."""
    results = {}
    for name, (flags, _) in case_flags(world_size).items():
        config = validate_args(parse_args(TINY + flags), world_size)
        state = ParallelState(config.parallel.grid, rank)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_training(config, state, torch.device("cpu"), eod=None)
        results[name] = [(log["iteration"], log["learning_rate"], log["global_batch_size"])
                         for log in parse_log(out.getvalue())]
    return results


@pytest.mark.parametrize("dp", [2, 4])
def test_logged_lr_follows_the_closed_form_without_global_batch(dp):
    logged = run_distributed(dp, _logged_rates, timeout=600)[dp - 1]
    for name, (_, closed_form) in case_flags(dp).items():
        rows = logged[name]
        assert [it for it, _, _ in rows] == list(range(1, ITERS + 1)), name
        assert {gbs for _, _, gbs in rows} == {MICRO * dp}, name
        for it, lr, _ in rows:
            # The log prints 7 significant digits.
            assert lr == pytest.approx(closed_form(it), rel=1e-6, abs=1e-12), (name, it)
    assert dict((it, lr) for it, lr, _ in logged["linear"])[10] == 5.0e-4
