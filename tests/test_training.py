"""End-to-end single-process training through pretrain(), as pretrain_gpt.py runs it."""

import math
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalite.training import pretrain
from megalite.training_log import parse_log, parse_validation_line

from tests.helpers import BASE_FLAGS, flags_with, without

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def run(capsys, *flags):
    code = pretrain(list(flags))
    out, err = capsys.readouterr()
    logs = parse_log(out)
    return code, out, err, logs


def mock_entropy_rate(vocab_size: int) -> float:
    """Bayes-optimal loss (nats/token) on --mock-data: documents 1..L then eod with L
    uniform on 1..M, M = vocab - 2. After eod the next token is 1 for sure; after token t
    the document ends with probability 1/(M - t + 1), and token t is reached with
    probability (M - t + 1)/M. Mean document length is (M + 1)/2 + 1 tokens."""
    M = vocab_size - 2

    def h(p):
        return 0.0 if p in (0.0, 1.0) else -(p * math.log(p) + (1 - p) * math.log(1 - p))
    expected = sum((M - t + 1) / M * h(1 / (M - t + 1)) for t in range(1, M + 1))
    return expected / ((M + 1) / 2 + 1)


def test_learns_the_synthetic_task(capsys):
    """From log(64) = 4.16 nats at init to within 0.15 nats of the Bayes-optimal 0.13:
    that needs both the counting rule and the document-end hazard to be learned."""
    flags = flags_with(train_iters=250) + NO_DROPOUT + [
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "20", "--log-interval", "50", "--eval-interval", "1000",
        "--eval-iters", "8", "--global-batch-size", "16", "--weight-decay", "0.1"]
    code, out, _, logs = run(capsys, *flags)
    assert code == 0
    bayes = mock_entropy_rate(64)
    assert 0.1 < bayes < 0.2
    assert logs[0]["lm_loss"] > 1.0  # mean of the first 50 iterations
    final = {v["prefix"]: v["loss"] for v in map(parse_validation_line, out.splitlines()) if v}
    assert final["iteration 250 on validation set"] < bayes + 0.15


def test_log_line_fields(capsys):
    code, out, _, logs = run(capsys, *flags_with(train_iters=6), "--log-interval", "3",
                             "--log-throughput", "--eval-iters", "0")
    assert code == 0 and len(logs) == 2
    first, second = logs
    assert (first["iteration"], first["train_iters"], first["consumed_samples"],
            first["global_batch_size"]) == (3, 6, 24, 8)
    assert second["consumed_samples"] == 48
    assert first["tflops_per_gpu"] is not None and first["tflops_per_gpu"] > 0
    assert first["loss_scale"] == 1.0 and first["skipped_iters"] == 0 and first["nan_iters"] == 0
    # 8 samples x 32 tokens per iteration.
    assert first["tokens_per_second"] == pytest.approx(256 / (first["elapsed_ms"] / 1e3),
                                                       rel=0.02)
    _, _, _, plain = run(capsys, *flags_with(train_iters=2), "--log-interval", "1",
                         "--eval-iters", "0")
    assert plain[0]["tflops_per_gpu"] is None


def test_tensorboard_event_file(capsys, tmp_path):
    code, *_ = run(capsys, *flags_with(train_iters=4), "--log-interval", "2",
                   "--eval-interval", "2", "--eval-iters", "1", "--tensorboard-dir",
                   str(tmp_path))
    assert code == 0
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "loss-scale", "throughput",
            "lm loss validation", "lm loss validation ppl"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4]
    ppl, val = events.Scalars("lm loss validation ppl")[0], events.Scalars("lm loss validation")[0]
    assert ppl.value == pytest.approx(math.exp(val.value), rel=1e-5)


def test_deterministic_under_seed(capsys):
    """Dropout on: the same seed gives the same losses, another seed other losses."""
    common = flags_with(train_iters=4) + ["--log-interval", "1", "--eval-iters", "0"]
    losses = [[r["lm_loss"] for r in run(capsys, *common, "--seed", seed)[3]]
              for seed in ("5", "5", "6")]
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


def test_exit_interval_and_train_samples(capsys):
    code, out, _, logs = run(capsys, *flags_with(train_iters=10), "--log-interval", "1",
                             "--eval-iters", "0", "--exit-interval", "3")
    assert code == 0 and [r["iteration"] for r in logs] == [1, 2, 3]
    assert "exiting program at iteration 3" in out
    flags = without(BASE_FLAGS, "--train-iters")
    code, _, _, logs = run(capsys, *flags, "--train-samples", "20", "--log-interval", "1",
                           "--eval-iters", "0")
    assert code == 0 and [(r["iteration"], r["train_iters"]) for r in logs] == [(1, 2), (2, 2)]


def test_fp16_overflow_skips_and_backs_off(capsys):
    """Scale 2^40 overflows fp16 activation grads (max 65504); with --hysteresis 1 each
    overflow halves the scale and the step is skipped, and the lr schedule waits."""
    tiny = ["--hidden-size", "16", "--num-attention-heads", "2", "--num-layers", "1",
            "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2"]
    code, _, _, logs = run(capsys, *BASE_FLAGS, *tiny, "--train-iters", "3", "--fp16",
                           "--initial-loss-scale", str(2.0 ** 40), "--hysteresis", "1",
                           "--log-interval", "1", "--eval-iters", "0",
                           "--lr-warmup-iters", "2")
    assert code == 0
    assert [r["loss_scale"] for r in logs] == [2.0 ** 40, 2.0 ** 39, 2.0 ** 38]
    assert [r["skipped_iters"] for r in logs] == [1, 1, 1]
    assert all(r["grad_norm"] is None for r in logs)
    assert {r["learning_rate"] for r in logs} == {0.0}  # warm-up never advanced


def test_bf16_learns_and_tracks_fp32(capsys):
    """--bf16 (bf16 parameters, fp32 main parameters and loss) against the fp32 run, step
    by step. bf16 keeps 8 mantissa bits: unit round-off u = 2^-8 = 0.4%. Each step's loss
    is a mean over 256 tokens of fp32 log-softmaxes of bf16 logits, so it carries about u
    of relative error, and the two trajectories drift apart only slowly in 40 steps of a
    smooth problem. Bound: every step within 4u = 1.6%, the mean within u."""
    flags = [*flags_with(train_iters=40), *NO_DROPOUT, "--lr", "3e-3", "--log-interval", "1",
             "--eval-iters", "0"]
    fp32 = [r["lm_loss"] for r in run(capsys, *flags)[3]]
    code, _, _, logs = run(capsys, *flags, "--bf16")
    bf16 = [r["lm_loss"] for r in logs]
    assert code == 0 and len(bf16) == len(fp32) == 40
    assert bf16[-1] < bf16[0] - 2.0  # it learns: 4.2 -> ~1.0 nats
    relative = [abs(a - b) / a for a, b in zip(fp32, bf16)]
    assert max(relative) < 4 * 2 ** -8
    assert sum(relative) / len(relative) < 2 ** -8


def test_nan_loss_is_a_named_error(capsys):
    code, _, err, _ = run(capsys, *flags_with(train_iters=30), "--lr", "1e9",
                          "--clip-grad", "0", "--eval-iters", "0", "--weight-decay", "0")
    assert code == 1
    # Stopped before the optimizer step, naming the iteration and the rank.
    assert re.search(r"iteration \d+: (lm loss|a gradient) is NaN or infinite on rank\(s\) "
                     r"\[0\]; stopped before the optimizer step", err)
