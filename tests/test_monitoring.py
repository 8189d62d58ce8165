"""Monitoring in one process (issue 17): MFU against the datasheet peaks, memory on the
log line and in TensorBoard, Megatron's timers at each level (and nothing run at level 0),
params norm and zeros in the gradients, a profiler trace. The multi-rank parts (max over
ranks, stragglers, replica hashes) are in tests/distributed/test_monitoring_layouts.py."""

import contextlib
import io
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import megalite.monitoring.peak_flops as peak_flops
import megalite.monitoring.profiling as profiling
import megalite.timers as timers_module
import megalite.training as training
from megalite.config import OptimizerConfig
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.monitoring.watchdog import Watchdog
from megalite.optimizer.optimizer import Optimizer
from megalite.training import pretrain
from megalite.training_log import parse_log, parse_log_line

from tests.helpers import BASE_FLAGS, checkpoint_tensors, tiny_gpt_config

FLAGS = [*BASE_FLAGS, "--eval-iters", "0", "--num-workers", "0", "--train-iters", "4",
         "--log-interval", "2"]  # global batch 8 of micro-batches of 4: 2 per step
MIB = 2 ** 20
ROOT = Path(__file__).resolve().parents[1]

# Megatron's timer names, by the level that first prints them (single process, fp32).
LEVEL_1 = {"batch-generator", "loss-all-reduce", "forward-backward", "all-grads-sync",
           "optimizer", "optimizer-clip-main-grad", "grad-norm-all-reduce",
           "optimizer-inner-step", "optimizer-copy-main-to-model-params"}
LEVEL_2 = LEVEL_1 | {"forward-compute", "backward-compute"}
TOP_LEVEL = ("batch-generator", "loss-all-reduce", "forward-backward", "all-grads-sync",
             "optimizer")


def run(*flags, tmp=None) -> tuple[str, list[dict]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pretrain([*FLAGS, *flags]) == 0
    text = out.getvalue()
    return text, parse_log(text)


@pytest.fixture(scope="module")
def level_2(tmp_path_factory):
    """Timers at level 2, a known peak, memory and parameter statistics in TensorBoard,
    a checkpoint, and a profile of iterations 2-3."""
    tmp = tmp_path_factory.mktemp("level_2")
    out, logs = run("--log-throughput", "--peak-tflops", "0.002", "--timing-log-level", "2",
                    "--tensorboard-dir", str(tmp / "tb"), "--log-memory-to-tensorboard",
                    "--log-timers-to-tensorboard", "--log-params-norm", "--log-num-zeros-in-grad",
                    "--save", str(tmp / "ckpt"),
                    "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                    "--profile-dir", str(tmp / "profile"))
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, resident_bytes())
    return out, logs, tmp, peak


@pytest.fixture(scope="module")
def level_1():
    """Timers at level 1 (max over ranks) on a stubbed H100."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peak_flops, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
        return run("--log-throughput", "--timing-log-level", "1", "--timing-log-option", "max",
                   "--scaling-baseline-tokens-per-sec", "100")


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def table_peak(name: str, dtype: str) -> float | None:
    key = peak_flops.device_key(name)
    return peak_flops.PEAK_TFLOPS[key].get(dtype) if key else None


def test_peak_table_is_dense_and_matched_by_device_name():
    # Datasheet dense rates (NVIDIA prints twice these "with sparsity").
    cases = {("NVIDIA H100 80GB HBM3", "bf16"): 989.4, ("NVIDIA H100 PCIe", "bf16"): 756.5,
             ("NVIDIA H100 NVL", "fp16"): 835.5, ("NVIDIA H200", "bf16"): 989.4,
             ("NVIDIA A100-SXM4-40GB", "bf16"): 312.0, ("NVIDIA A100 80GB PCIe", "tf32"): 156.0,
             ("NVIDIA A100-SXM4-80GB", "fp32"): 19.5, ("NVIDIA L40S", "bf16"): 362.05,
             ("NVIDIA L4", "bf16"): 121.0, ("NVIDIA A10", "fp32"): 31.2,
             ("Tesla V100-SXM2-16GB", "bf16"): None, ("NVIDIA GeForce GTX 1080", "fp32"): None}
    for (name, dtype), peak in cases.items():
        assert table_peak(name, dtype) == peak, name


def test_a_variant_is_not_shadowed_by_its_family():
    """A card whose name contains another's (H200 NVL holds "H200", GB200 "B200", the V100
    PCIe cards "V100") gets its own dense peak: half its datasheet's "with sparsity" figure
    where the datasheet prints only that."""
    cases = {  # (name, dtype): datasheet TFLOP/s, halved where sparse
        # NVIDIA H200 datasheet, H200 NVL column: BF16 1,671 and TF32 835 with sparsity.
        ("NVIDIA H200 NVL", "bf16"): 1671 / 2, ("NVIDIA H200 NVL", "tf32"): 835 / 2,
        ("NVIDIA H200 NVL", "fp32"): 60.0,
        # NVIDIA GH200 datasheet: BF16 1,979 with sparsity, 989.4 dense (the H100 SXM's).
        ("NVIDIA GH200 480GB", "bf16"): 989.4,
        # NVIDIA GB200 NVL72: 10 PFLOPS BF16 and 160 TFLOPS FP32 per superchip of 2 GPUs.
        ("NVIDIA GB200", "bf16"): 10_000 / 2 / 2, ("NVIDIA GB200", "fp32"): 160 / 2,
        # NVIDIA V100 datasheet: PCIe 112 and V100S PCIe 130 tensor TFLOPS (dense).
        ("Tesla V100-PCIE-32GB", "fp16"): 112.0, ("Tesla V100S-PCIE-32GB", "fp16"): 130.0,
        ("NVIDIA L40", "bf16"): None, ("NVIDIA A10G", "bf16"): None}
    for (name, dtype), peak in cases.items():
        assert table_peak(name, dtype) == peak, name


def test_mfu_percent_by_hand():
    # 400 TFLOP/s on an H100 SXM's dense bf16 989.4: 40.43%, as PaLM's appendix B divides.
    assert peak_flops.mfu_percent(400.0, 989.4) == pytest.approx(40.4285, abs=1e-4)
    assert peak_flops.mfu_percent(0.001, 0.002) == 50.0


def test_mfu_is_throughput_over_the_peak(level_1, level_2):
    # fp32 on a device whose float32 matmul precision is "highest" runs at the FP32 rate.
    for (_, logs, *_), peak in ((level_1, 66.9), (level_2, 0.002)):
        assert len(logs) == 2
        for log in logs:
            assert log["mfu_percent"] == pytest.approx(100 * log["tflops_per_gpu"] / peak,
                                                       rel=2e-3)


def test_scaling_efficiency_is_tokens_per_second_per_gpu_over_the_baseline(level_1, level_2):
    # One process and --scaling-baseline-tokens-per-sec 100 (level 1 only).
    for log in level_1[1]:
        assert log["scaling_efficiency_percent"] == pytest.approx(
            log["tokens_per_second"] / 100 * 100, abs=0.06)
    assert all(log["scaling_efficiency_percent"] is None for log in level_2[1])


def test_memory_on_the_log_line_and_in_tensorboard(level_2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, logs, tmp, peak_after = level_2
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    rss = {e.step: e.value for e in events.Scalars("mem-rss-bytes")}
    max_rss = {e.step: e.value for e in events.Scalars("mem-max-rss-bytes")}
    assert sorted(rss) == sorted(max_rss) == [2, 4]
    for log in logs:
        it, mib = log["iteration"], log["memory_mib"]
        assert mib["RSS"] == pytest.approx(rss[it] / MIB, abs=0.06)
        assert mib["max RSS"] == pytest.approx(max_rss[it] / MIB, abs=0.06)
        # The kernel raises its high-water mark (ru_maxrss) lazily, so an RSS read during the
        # run may pass the mark read afterwards by the pages touched since its last update
        # (94 KiB seen here): a small slack, far below what a wrong unit would give.
        assert 50 * MIB < rss[it] <= max_rss[it] <= peak_after + 4 * MIB


def test_timers_mfu_and_statistics_in_tensorboard(level_2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, logs, tmp, _ = level_2
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()

    def scalar(tag):
        return {e.step: e.value for e in events.Scalars(tag)}
    blocks = timer_lines(out)
    for name in LEVEL_2:  # seconds per iteration, printed in ms to 2 decimals
        for it, seconds in scalar(f"{name}-time").items():
            assert seconds * 1e3 == pytest.approx(blocks[it][name], abs=0.006), name
    for log in logs:
        it = log["iteration"]
        assert scalar("mfu-percent")[it] == pytest.approx(log["mfu_percent"], rel=1e-3)
        assert scalar("params-norm")[it] == pytest.approx(log["params_norm"], abs=6e-4)
        assert scalar("num-zeros")[it] == log["num_zeros"]


@pytest.mark.parametrize("flags, message", [
    (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"],
     "--profile needs 0 <= --profile-step-start < --profile-step-end, got 3 and 3"),
    (["--profile", "--profile-ranks", "0", "2"], "--profile-ranks [2] outside the world of 1"),
    (["--peak-tflops", "0"], "--peak-tflops must be positive, got 0.0"),
    (["--record-memory-history"], "--record-memory-history records the CUDA allocator"),
])
def test_bad_monitoring_flags_are_named(capsys, flags, message):
    if "--record-memory-history" in flags and torch.cuda.is_available():
        pytest.skip("a GPU is visible: the memory history can be recorded")
    assert pretrain([*FLAGS, *flags]) != 0
    assert message in capsys.readouterr().err


def timer_lines(out: str) -> dict[int, dict[str, float]]:
    """Per log line's iteration: each timer's max over ranks (ms per iteration)."""
    blocks, current = {}, None
    for line in out.splitlines():
        if fields := parse_log_line(line):
            current = blocks.setdefault(fields["iteration"], {})
        m = re.match(r"^ +(\S+) \.*: \(?([\d.]+)(?:, ([\d.]+)\))?$", line)
        if m and current is not None:
            current[m[1]] = float(m[3] or m[2])
    return blocks


def test_timers_name_each_phase_and_fit_in_the_step(level_1, level_2):
    for (out, logs, *_), level in ((level_1[:2], 1), (level_2[:2], 2)):
        header = ("max time across ranks (ms):" if level == 1 else
                  "(min, max) time across ranks (ms):")
        assert out.count(header) == 2
        blocks = timer_lines(out)
        for log in logs:
            timers = blocks[log["iteration"]]
            assert set(timers) == (LEVEL_1 if level == 1 else LEVEL_2)
            # Phases that do not nest add up to at most the iteration.
            assert sum(timers[n] for n in TOP_LEVEL) <= log["elapsed_ms"] * 1.001 + 0.05
            if level == 2:
                assert timers["forward-compute"] + timers["backward-compute"] <= \
                    timers["forward-backward"] + 0.02


def test_timing_level_zero_starts_no_timer_and_records_nothing(monkeypatch):
    counts = {"start": 0, "event": 0}
    start, timing_event = timers_module.Timer.start, timers_module.timing_event

    def counted_start(self):
        counts["start"] += 1
        start(self)

    def counted_event(device):
        counts["event"] += 1
        return timing_event(device)
    monkeypatch.setattr(timers_module.Timer, "start", counted_start)
    monkeypatch.setattr(timers_module, "timing_event", counted_event)
    out, logs = run("--log-throughput")
    assert counts == {"start": 0, "event": 0} and "time across ranks" not in out
    # A CPU: no MFU without --peak-tflops; its ~1e-4 TFLOP/s in fixed point, not 1.2e-04.
    assert len(logs) == 2 and all(log["mfu_percent"] is None for log in logs) and "e-0" not in out
    timers_module.Timers(1).timers["optimizer"].start()  # the counters do count
    assert counts == {"start": 1, "event": 1}


def test_params_norm_is_the_norm_of_the_saved_weights(level_2):
    _, logs, tmp, _ = level_2
    weights = [v for k, v in checkpoint_tensors(tmp / "ckpt").items()
               if k.startswith("model_") and torch.is_tensor(v) and v.is_floating_point()]
    norm = torch.sqrt(sum(w.double().square().sum() for w in weights)).item()
    assert logs[-1]["params_norm"] == pytest.approx(norm, abs=1.5e-3)
    assert all(log["num_zeros"] is not None for log in logs)


def test_num_zeros_in_grad_counts_zero_elements():
    model = GPTModel(tiny_gpt_config(), seed=1)
    optimizer = Optimizer(model, OptimizerConfig(lr=1e-3, clip_grad=0.0))
    expected = 0
    for i, p in enumerate(model.parameters()):
        grad = torch.randn_like(p)
        grad.view(-1)[:i] = 0  # i zeros in the i-th parameter
        expected += min(i, p.numel())
        p.grad = grad
    optimizer.step()
    assert optimizer.num_zeros_in_grad() == expected


def test_profile_holds_megalites_phases_for_the_requested_steps(level_2):
    out, _, tmp, _ = level_2
    assert [p.name for p in (tmp / "profile").iterdir()] == ["rank0.iter2-3.pt.trace.json"]
    with open(tmp / "profile" / "rank0.iter2-3.pt.trace.json") as f:
        events = json.load(f)["traceEvents"]
    names = [e.get("name") for e in events if e.get("ph") == "X"]
    # 2 profiled steps of 2 micro-batches each.
    counts = {n: names.count(n) for n in ("forward-compute", "backward-compute",
                                          "batch-generator", "forward-backward",
                                          "all-grads-sync", "optimizer",
                                          "optimizer-inner-step")}
    assert counts == {"forward-compute": 4, "backward-compute": 4, "batch-generator": 2,
                      "forward-backward": 2, "all-grads-sync": 2, "optimizer": 2,
                      "optimizer-inner-step": 2}
    assert "profile of iterations 2-3 written" in out


def test_memory_history_covers_the_model_and_is_written_after_the_first_log_interval(
        tmp_path, monkeypatch):
    """--record-memory-history without --profile, the CUDA allocator stubbed (the device
    check told this CPU is one): the recording starts before the model's first parameter,
    and the snapshot is written once, after the first log interval (iteration 2 of 4)."""
    events = []

    def dump(path):
        events.append("dump")
        open(path, "wb").close()

    def build(*args, **kwargs):
        events.append("model")
        return build_model_chunks(*args, **kwargs)
    monkeypatch.setattr(profiling, "on_cuda", lambda device: True, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kwargs: events.append("record"))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monkeypatch.setattr(training, "build_model_chunks", build)
    path = tmp_path / "snapshot.pickle"
    out, logs = run("--record-memory-history", "--memory-snapshot-path", str(path))
    assert events == ["record", "model", "dump"] and path.is_file()
    lines = [line for line in out.splitlines() if parse_log_line(line) or "snapshot" in line]
    assert [parse_log_line(line) is None for line in lines] == [False, True, False], lines


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory snapshots need a GPU")
@pytest.mark.slow  # the default path on a GPU compiles layers: inductor's worker processes
def test_memory_snapshot_on_gpu(tmp_path):
    import pickle
    path = tmp_path / "snapshot.pickle"
    run("--record-memory-history", "--memory-snapshot-path", str(path), "--profile",
        "--profile-step-start", "1", "--profile-step-end", "2", "--profile-dir", str(tmp_path))
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and snapshot["device_traces"]


# A save whose file writes take longer than the watchdog's limit (a slow file system),
# then a step that never returns, as a collective whose peer stopped can on gloo: the main
# thread waits and nothing raises.
_SLOW_SAVE_THEN_HUNG_STEP = """
import sys, threading, time
from megalite.checkpointing import saving
from megalite.train_step import StepRunner
from megalite.training import pretrain
write, step, calls, writes = saving.save_tensor_file, StepRunner.train_step, [], []
def save_tensor_file(obj, path):
    writes.append(1)
    if len(writes) == 1:  # one slow file is enough
        time.sleep(7.0)
    write(obj, path)
def train_step(self, batches):
    calls.append(1)
    if len(calls) == 3:
        threading.Event().wait()
    return step(self, batches)
saving.save_tensor_file, StepRunner.train_step = save_tensor_file, train_step
sys.exit(pretrain(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_slow_save_is_kept_and_a_step_that_never_returns_ends_the_process(tmp_path):
    """With --distributed-timeout-minutes 0.05 (3 s) the watchdog's limit is 6 s. The save
    at iteration 2 writes for 7 s and is published (its writes are not watched: a slow disk
    must not cost the checkpoint); the step after it never returns, and the watchdog ends
    the process 6 s after the last progress, naming itself, so a restart policy can run;
    before the watchdog, the process waited forever (here: until the test's 120 s)."""
    flags = [*FLAGS, "--train-iters", "10", "--distributed-timeout-minutes", "0.05",
             "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _SLOW_SAVE_THEN_HUNG_STEP, *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "error (rank 0): no training progress for 6 s (twice " \
           "--distributed-timeout-minutes)" in done.stderr, done.stderr[-2000:]
    assert "iteration        2/" in done.stdout and time.monotonic() - start < 110
    assert "successfully saved checkpoint at iteration       2" in done.stdout, done.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_the_watchdog_waits_out_a_suspended_stretch_then_calls_a_stall():
    """Against the wall clock: limit 0.2 s (timeout 0.1 s), polled every 0.02 s."""
    stalls = []
    dog = Watchdog(0.1, rank=3, on_stall=stalls.append)
    try:
        time.sleep(0.4)
        assert stalls == []  # not armed before the first step
        dog.beat()
        with dog.suspended():
            time.sleep(0.5)
        assert stalls == []
        time.sleep(0.5)
        assert len(stalls) == 1 and stalls[0].startswith("error (rank 3): no training "
                                                         "progress for 0.2 s")
    finally:
        dog.close()
