"""The time and cost planner (megalite/cost/, tools/estimate_cost.py) against independent
references: the published worked example (8 A100s for 24 hours at $3.00 and $1.20 per
GPU-hour), the count of FLOPs the MFU divides by and the dense-GPT closed form, a seeded
Monte-Carlo simulation of preemptions for Young/Daly's interval and the expected total
time, and a cluster check's REPORT.md as its own writer writes it."""

import math
import re

import numpy as np
import pytest

from megalite.arguments import parse_args
from megalite.cluster_check import checkpoint, tuning
from megalite.cluster_check.report import Section, table, write_report
from megalite.cost.plan import SpotRun, flops_per_token, optimal_interval
from megalite.cost.prices import DEFAULT_TABLE, load_offers
from megalite.monitoring.peak_flops import PEAK_TFLOPS
from megalite.training_log import num_floating_point_operations
from megalite.validation import validate_model_args

from tests.helpers import load_tool

estimate_cost = load_tool("estimate_cost")
GPT2 = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
        "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "50257"]
LLAMA_MOE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
             "--group-query-attention", "--num-query-groups", "2", "--seq-length", "512",
             "--vocab-size", "1000", "--swiglu", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "128", "--disable-bias-linear"]
LLAMA = [*GPT2, "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def model(flags, world=1):
    return validate_model_args(parse_args(flags), world).model


def plan(capsys, *argv) -> str:
    code = estimate_cost.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def error(capsys, *argv) -> str:
    assert estimate_cost.main(list(argv)) == 2
    return capsys.readouterr().err


def test_published_worked_example_8_a100_for_24_hours(capsys):
    """The survey's example: 8 A100s for 24 hours, $576 on demand at $3.00 per GPU-hour and
    $230 on spot at $1.20. The tokens are those 24 hours at 312 TFLOP/s x MFU 0.4 by the
    MFU's count of FLOPs."""
    flags = [*GPT2, "--bf16"]
    per_token = num_floating_point_operations(model(flags), 1) / 1024
    tokens = 24 * 3600 * 8 * 312e12 * 0.4 / per_token
    out = plan(capsys, "--gpu", "a100", "--num-gpus", "8", "--mfu", "0.4", "--train-tokens",
               repr(tokens), "--on-demand-price", "3.00", "--spot-price", "1.20", *flags)
    assert "time: 24.00 h wall-clock, 192.0 GPU-hours" in out, out
    assert "cost on demand: 192.0 GPU-hours x $3 (--on-demand-price) = $576.00" in out
    assert "cost spot: 192.0 GPU-hours x $1.2 (--spot-price) = $230.40 before preemptions" in out


def test_flops_per_token_are_the_mfus():
    """Per token, the count the log line's TFLOP/s and MFU divide by (a step of global
    batch B: num_floating_point_operations(model, B) over B x s tokens), and for a GPT-2
    shape the dense closed form 72 L h^2 (1 + s/(12 h) + V/(12 L h)) (Narayanan et al. 2021
    with the causal half of the attention core)."""
    gpt2 = model(GPT2)
    for m in (gpt2, model(LLAMA_MOE), model(LLAMA)):
        assert flops_per_token(m) == pytest.approx(
            num_floating_point_operations(m, 256) / (256 * m.seq_length), rel=1e-12)
    L, h, s, V = 12, 768, 1024, gpt2.padded_vocab_size
    assert flops_per_token(gpt2) == pytest.approx(
        72 * L * h * h * (1 + s / (12 * h) + V / (12 * L * h)), rel=1e-12)


def simulated_total_s(work_s, interval_s, save_s, mtbf_s, restart_s, runs, rng) -> float:
    """Mean wall-clock seconds of `runs` simulated runs: segments of `interval_s` work and a
    save, each retried from its start after a preemption (exponential, mean `mtbf_s`) until
    an attempt outlives it; a failed attempt loses its time up to the preemption."""
    full, rest = divmod(work_s, interval_s)
    total = 0.0
    for length, count in ((interval_s + save_s, int(full) * runs), (rest + save_s, runs)):
        if count == 0 or length == save_s:
            continue
        survive = math.exp(-length / mtbf_s)
        failures = int((rng.geometric(survive, size=count) - 1).sum())
        # Exponential times conditioned to fall inside the attempt (inverse CDF).
        u = rng.random(failures)
        lost = -mtbf_s * np.log1p(-u * (1 - survive))
        total += count * length + lost.sum() + failures * restart_s
    return total / runs


def test_young_daly_interval_minimises_the_simulated_total_time():
    """200 hours of work, a 60 s save, one preemption every 6 hours: the simulated mean
    total is least at the grid point nearest sqrt(2 C M) (Daly's correction, -C, and the
    flat minimum allow the neighbours), and the planner's expected total matches the
    simulation's at every interval."""
    rng = np.random.default_rng(45)
    work, save, mtbf, restart = 200 * 3600.0, 60.0, 6 * 3600.0, 300.0
    best = optimal_interval(save, mtbf)
    factors = [0.25, 0.5, 0.7, 0.85, 1.0, 1.18, 1.4, 2.0, 4.0]
    simulated = [simulated_total_s(work, f * best, save, mtbf, restart, 2000, rng)
                 for f in factors]
    assert factors[int(np.argmin(simulated))] in (0.85, 1.0, 1.18), simulated
    assert simulated[0] > simulated[4] * 1.02 and simulated[-1] > simulated[4] * 1.02
    for f, measured in zip(factors, simulated):
        planned = SpotRun(work, f * best, save, mtbf, restart).total_s
        assert planned == pytest.approx(measured, rel=0.01), (f, planned, measured)


def test_spot_plan_prints_the_interval_and_the_notice_warning(capsys):
    out = plan(capsys, "--gpu", "H100 SXM", "--num-gpus", "16", "--mfu", "0.4",
               "--train-iters", "1000", "--global-batch-size", "64", "--save-seconds", "50",
               "--preemption-rate", "0.1", "--preemption-notice-seconds", "30", "--save", "c",
               *GPT2, "--bf16")
    assert "tokens: 6.554e+07 (1000 iterations x global batch 64 x 1024 tokens)" in out
    # 0.1 per node-hour x 2 nodes: M = 5 h = 18000 s; sqrt(2 x 50 x 18000) s = 22.4 min.
    assert "one every 5 h" in out and "= 22.4 min of training between saves" in out, out
    assert "WARNING: the save takes longer than the 30 s --preemption-notice-seconds" in out
    assert "$12.29 (aws-p5)" in out  # the table's first H100 SXM offer


def test_cluster_report_gives_the_mfu_and_the_save_rate(tmp_path, capsys):
    """A REPORT.md as tools/check_cluster.py writes it: the tuning table's fastest row's
    MFU and the checkpoint table's save rate per rank."""
    tuned = Section(tuning.TITLE, table(
        ["layout", "tokens/s", "vs default", "MFU %", "estimated ms/step"],
        [["tp2", "900.0", "1.20x", "41.5", "10.0"], ["dp8 (default)", "750.0", "1.00x",
                                                        "34.6", "12.0"]]))
    saved = Section(checkpoint.TITLE, table(
        ["", "MB", "seconds", "GB/s total", "GB/s per rank"],
        [["save", "800.00", "1.000", "0.800", "0.100"], ["load", "800", "0.5", "1.6", "0.2"]]))
    write_report(str(tmp_path), [saved, tuned], {}, ["launch"])
    out = plan(capsys, "--gpu", "A100", "--num-gpus", "8", "--train-tokens", "1e9",
               "--cluster-report", str(tmp_path / "REPORT.md"), "--spot-price", "1", *GPT2)
    assert "MFU 0.415" in out, out
    assert "at 0.1 GB/s per rank (the cluster check's measured save rate)" in out, out


def test_bad_input_is_an_error_naming_the_flag(tmp_path, capsys):
    base = ["--num-gpus", "8", "--train-tokens", "1e9", *GPT2]
    assert "--gpu 'Z80': unknown GPU kind; known: H100 SXM" in error(
        capsys, "--gpu", "Z80", "--mfu", "0.4", *base)
    for mfu in ("0", "1.5", "45"):
        assert f"--mfu must be in (0, 1], a fraction of the peak, got {mfu}" in error(
            capsys, "--gpu", "A100", "--mfu", mfu, *base)
    assert "no price for H200 in" in error(capsys, "--gpu", "H200", "--mfu", "0.4", *base)
    assert "no price for MI355X in" in error(capsys, "--gpu", "MI355X", "--peak-tflops",
                                             "2500", "--mfu", "0.4", *base)
    assert "give --mfu" in error(capsys, "--gpu", "A100", *base)
    write_report(str(tmp_path), [], {}, ["launch"])  # no tuning table: no MFU
    assert "has none" in error(capsys, "--gpu", "A100", "--cluster-report",
                               str(tmp_path / "REPORT.md"), *base)
    assert "--offer 'azure': no such offer for A100" in error(
        capsys, "--gpu", "A100", "--mfu", "0.4", "--offer", "azure", *base)
    bad = tmp_path / "prices.yaml"
    bad.write_text("A100:\n  - offer: x\n    on_demand: -1\n    source: s\n    date: 2024\n")
    assert f"--prices {bad}: A100 x: on_demand must be a positive" in error(
        capsys, "--gpu", "A100", "--mfu", "0.4", "--prices", str(bad), *base)
    bad.write_text("A100:\n  - {offer: x, source: s, date: 2024, gpu: A100}\n")
    assert f"--prices {bad}: A100: each offer needs offer, source and date" in error(
        capsys, "--gpu", "A100", "--mfu", "0.4", "--prices", str(bad), *base)
    assert "--preemption-rate must be positive, got -1" in error(
        capsys, "--gpu", "A100", "--mfu", "0.4", "--preemption-rate", "-1", *base)
    assert "--gpu V100 has no bf16 tensor-core peak" in error(
        capsys, "--gpu", "V100", "--mfu", "0.4", "--bf16", *base)


def test_the_shipped_price_table():
    """Every offer of prices.yaml is a GPU kind with a peak, dated 2024-25, with its page."""
    offers = load_offers(DEFAULT_TABLE)
    assert offers and all(gpu in PEAK_TFLOPS for gpu in offers)
    for listed in offers.values():
        for offer in listed:
            assert re.fullmatch(r"202[45]-\d\d", offer.date), offer
            assert offer.source.startswith("https://") and offer.on_demand, offer
