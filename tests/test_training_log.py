"""parse_log_line and parse_validation_line read back exactly what log_line and
validation_lines write, with every optional field on and off."""

import itertools
import math
import re

import pytest

from megalite.training_log import (log_line, parse_log, parse_log_line, parse_validation_line,
                                   validation_lines)

# Values the line prints exactly (binary fractions within its digits), so the round trip
# must give them back unchanged.
REQUIRED = dict(iteration=30, train_iters=100, consumed_samples=240, elapsed_ms=812.5,
                learning_rate=3.0e-4, global_batch_size=8, lm_loss=2.53125,
                loss_scale=65536.0, skipped_iters=1, nan_iters=0, tokens_per_second=31500.5,
                # MoE runs only (tests/test_moe_report.py reads them back when present).
                moe_losses=None, expert_load=None,
                # MTP runs only (tests/test_mtp.py reads them back, beside MoE losses).
                mtp_losses=None)
OPTIONAL = dict(tflops_per_gpu=12.5, mfu_percent=41.25, grad_norm=1.125, num_zeros=7.0,
                params_norm=10.5, scaling_efficiency_percent=92.5, compression_ratio=105.5,
                cross_replica_bytes=167936.5,
                memory_mib={"allocated": 100.5, "reserved": 200.0,
                            "max allocated": 150.5})


@pytest.mark.parametrize("present", list(itertools.product([False, True],
                                                           repeat=len(OPTIONAL))))
def test_parse_log_line_reads_back_every_field(present):
    fields = {**REQUIRED, **{name: value if on else None
                             for (name, value), on in zip(OPTIONAL.items(), present)}}
    assert parse_log_line(log_line(**fields)) == fields


def test_log_line_is_megatrons_field_for_field():
    """The line written out by hand from Megatron's training_log (widths, labels, .6E),
    with megalite's four significant TFLOP/s, a MoE loss and the memory."""
    line = log_line(**{**REQUIRED, "moe_losses": {"load_balancing_loss": 1.25}},
                    tflops_per_gpu=0.0001234, grad_norm=1.125, memory_mib={"max allocated": 150.5})
    assert re.fullmatch(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", line[:22]), line
    assert line[22:] == (
        " iteration       30/     100 | consumed samples:          240 |"
        " elapsed time per iteration (ms): 812.5 | throughput per GPU (TFLOP/s/GPU): 0.0001234 |"
        " learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 2.531250E+00 |"
        " load_balancing_loss: 1.250000E+00 | loss scale: 65536.0 | grad norm: 1.125 |"
        " number of skipped iterations:   1 | number of nan iterations:   0 |"
        " tokens per second: 31500.5 | mem max allocated (MiB): 150.5 |")


def test_parse_log_line_reads_a_nan_loss_and_cpu_memory():
    fields = {**REQUIRED, **dict.fromkeys(OPTIONAL), "lm_loss": float("nan"), "nan_iters": 3,
              "memory_mib": {"RSS": 812.0, "max RSS": 900.5}}
    parsed = parse_log_line(log_line(**fields))
    assert math.isnan(parsed.pop("lm_loss"))
    fields.pop("lm_loss")
    assert parsed == fields


def test_parse_log_picks_the_log_lines_out_of_a_run_output():
    lines = [log_line(**REQUIRED, tflops_per_gpu=None, grad_norm=None),
             *validation_lines("iteration 30 on validation set", 2.5),
             "  forward-compute ...........: 1.0", log_line(**{**REQUIRED, "iteration": 31},
                                                           tflops_per_gpu=None, grad_norm=0.5)]
    assert [f["iteration"] for f in parse_log("\n".join(lines))] == [30, 31]
    assert parse_log_line(lines[1]) is None and parse_log_line("") is None


@pytest.mark.parametrize("loss", [2.5, 0.125, 30.0])
def test_parse_validation_line_reads_back_prefix_and_loss(loss):
    rule, body, _ = validation_lines("iteration 250 on validation set", loss)
    assert parse_validation_line(body) == {"prefix": "iteration 250 on validation set",
                                           "loss": loss}
    assert parse_validation_line(rule) is None
