"""Tokens/s and scaling efficiency of pretrain_gpt.py across DP, TP and PP layouts.

Each layout is a real `torchrun --standalone --nproc-per-node N pretrain_gpt.py` run on mock
data; the script parses Megatron's log line (`elapsed time per iteration (ms)`, `throughput
per GPU (TFLOP/s/GPU)`) and averages the iterations after the first --warmup ones. A layout
is named by its degrees, e.g. `1`, `dp2`, `tp2-pp2-dp2`; TP runs with --sequence-parallel,
PP with the plain 1F1B schedule over global batch / (micro batch x DP) micro-batches.

Strong scaling (default) keeps the global batch fixed, so a perfect N-process layout would
be N times faster; --scaling weak multiplies the global batch by N, so it would keep the
time per iteration. Either way, efficiency = tokens/s with N / (N x tokens/s with 1 process).

The reference, measured in the same run, is the machine's matmul rate: one process alone,
then N processes at once (a large fp32 matmul on the CPU, bf16 on GPUs). On a CPU the N
processes split the cores (OMP_NUM_THREADS = cores / N per process, the same split the
training runs get, so nobody oversubscribes), and the N-process matmul rate over the
1-process rate is the most any layout could gain here.

The same script runs unchanged on a GPU node: one process per GPU, NCCL (megalite picks
the backend), --bf16 and a bigger default model.

    python benchmarks/scaling.py                              # every layout that fits
    python benchmarks/scaling.py --layouts 1 dp2 tp2 pp2 --iters 20
    python benchmarks/scaling.py --layouts 1 tp2-pp2-dp2 --scaling weak --nproc-max 8

SMOKE=1: the 2-process layouts (1, dp2, tp2, pp2) of a tiny model, 3 iterations each.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.parallel_state import RankGrid, num_microbatches
from megalite.spawn import torchrun_command
from megalite.training_log import parse_log

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")

# Layouts tried by default, by process count; those above --nproc-max are skipped.
DEFAULT_LAYOUTS = {
    1: ["1"],
    2: ["dp2", "tp2", "pp2"],
    4: ["dp4", "tp4", "pp4", "tp2-dp2", "pp2-dp2", "tp2-pp2"],
    8: ["dp8", "tp8", "pp8", "tp2-pp2-dp2", "tp4-dp2", "tp2-pp4"],
}

# Model and batch defaults: small enough for a 2-core CPU, and a GPU-sized model on GPUs.
CPU_MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256,
                 vocab_size=8192, micro_batch_size=4, global_batch_size=16)
GPU_MODEL = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                 vocab_size=32768, micro_batch_size=2, global_batch_size=64)

def parse_layout(name: str) -> RankGrid:
    """'1', 'dp2', 'tp2-pp2-dp2', ... -> the grid of TP x PP x DP processes."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for part in name.split("-") if name != "1" else []:
        match = re.fullmatch(r"(tp|pp|dp)([1-9][0-9]*)", part)
        if match is None:
            raise SystemExit(f"layout {name!r}: parts are tpN, ppN or dpN joined by '-'")
        sizes[match.group(1)] = int(match.group(2))
    return RankGrid(sizes["tp"] * sizes["pp"] * sizes["dp"], sizes["tp"], sizes["pp"])


def why_not(grid: RankGrid, args, global_batch: int) -> str | None:
    """Why this model and batch cannot run on this grid, or None if it can."""
    tp, pp = grid.tensor_model_parallel_size, grid.pipeline_model_parallel_size
    if args.num_attention_heads % tp:
        return f"{args.num_attention_heads} heads not divisible by TP {tp}"
    if args.num_layers % pp:
        return f"{args.num_layers} layers not divisible by PP {pp}"
    if global_batch % (args.micro_batch_size * grid.data_parallel_size):
        return f"global batch {global_batch} not divisible by micro batch x DP"
    return None


# ----------------------------------------------------------------------------------------
# The machine: device count, threads per process, matmul reference.

def on_gpu() -> bool:
    return torch.cuda.is_available()


def device_count() -> int:
    if on_gpu():
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def process_env(nproc: int) -> dict:
    """Environment of one of `nproc` processes: on a CPU, an equal share of the cores, so
    N processes never run more threads than there are cores (torchrun would set 1)."""
    env = dict(os.environ)
    if not on_gpu():
        env["OMP_NUM_THREADS"] = str(max(1, device_count() // nproc))
    return env


MATMUL_WORKER = """
import sys, time, torch
n, seconds, rank = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device != "cpu" else torch.float32
a = torch.randn(n, n, device=device, dtype=dtype)
b = torch.randn(n, n, device=device, dtype=dtype)
for _ in range(3):
    a @ b
torch.cuda.synchronize(device) if device != "cpu" else None
print("ready", flush=True)
sys.stdin.readline()  # every process starts timing together
iters, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    for _ in range(10 if device != "cpu" else 1):
        a @ b
        iters += 1
    torch.cuda.synchronize(device) if device != "cpu" else None
print(2 * n ** 3 * iters / (time.perf_counter() - start), flush=True)
"""


def matmul_rate(nproc: int, n: int, seconds: float) -> float:
    """Sum of the matmul FLOP/s of `nproc` processes timing an n^3 matmul at once."""
    procs = [subprocess.Popen([sys.executable, "-c", MATMUL_WORKER, str(n), str(seconds),
                               str(rank)], env=process_env(nproc), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for rank in range(nproc)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a matmul reference process failed to start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    rates = [float(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a matmul reference process failed")
    return sum(rates)


# ----------------------------------------------------------------------------------------
# One training run.

def pretrain_command(grid: RankGrid, args, global_batch: int) -> list[str]:
    cmd = torchrun_command(grid.world_size, PRETRAIN, [
           "--mock-data", "--vocab-size", str(args.vocab_size),
           "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
           "--num-attention-heads", str(args.num_attention_heads),
           "--seq-length", str(args.seq_length),
           "--max-position-embeddings", str(args.seq_length),
           "--micro-batch-size", str(args.micro_batch_size),
           "--global-batch-size", str(global_batch),
           "--train-iters", str(args.iters), "--lr", "1e-4",
           "--attention-dropout", "0", "--hidden-dropout", "0",
           "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
           "--num-workers", "0",
           "--tensor-model-parallel-size", str(grid.tensor_model_parallel_size),
           "--pipeline-model-parallel-size", str(grid.pipeline_model_parallel_size)])
    if grid.tensor_model_parallel_size > 1:
        cmd.append("--sequence-parallel")
    if args.bf16:
        cmd.append("--bf16")
    return cmd


@dataclass
class Result:
    ms_per_iter: float
    ms_stdev: float
    ms_fastest: float
    tflops_per_process: float
    load_after: float = 0.0  # 1-minute load average when the run ended


def run_layout(name: str, grid: RankGrid, args, global_batch: int) -> Result:
    """Mean over the iterations after --warmup of one torchrun job's log lines."""
    cmd = pretrain_command(grid, args, global_batch)
    out = subprocess.run(cmd, env=process_env(grid.world_size), cwd=ROOT, capture_output=True,
                         text=True, timeout=args.timeout)
    if out.returncode:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise RuntimeError(f"layout {name} failed: {' '.join(cmd)}")
    logs = [log for log in parse_log(out.stdout) if log["tflops_per_gpu"] is not None]
    ms = [log["elapsed_ms"] for log in logs][args.warmup:]
    tflops = [log["tflops_per_gpu"] for log in logs][args.warmup:]
    if not ms:
        raise RuntimeError(f"layout {name}: no log lines after {args.warmup} warm-up "
                           f"iterations; raise --iters")
    # FLOPs per step is fixed, so the mean time gives the mean rate (not the mean of rates).
    flops_ms = statistics.fmean(t * m for t, m in zip(tflops, ms))
    mean_ms = statistics.fmean(ms)
    stdev = statistics.stdev(ms) if len(ms) > 1 else 0.0
    return Result(mean_ms, stdev, min(ms), flops_ms / mean_ms)


# ----------------------------------------------------------------------------------------

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=None,
                   help="Layouts to run, e.g. 1 dp2 tp2 pp2 tp2-pp2-dp2 (default: every "
                        "default layout of at most --nproc-max processes). '1' is always run "
                        "first: it is the efficiency baseline.")
    p.add_argument("--nproc-max", type=int, default=None,
                   help="Most processes per layout (default: GPUs, else CPU cores).")
    p.add_argument("--scaling", choices=["strong", "weak"], default="strong",
                   help="strong: fixed global batch; weak: global batch x processes.")
    p.add_argument("--iters", type=int, default=10, help="--train-iters of each run.")
    p.add_argument("--warmup", type=int, default=2, help="Leading iterations left out.")
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 reference.")
    p.add_argument("--matmul-seconds", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=900, help="Seconds per training run.")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="Train in bf16 (default: on GPUs only).")
    for key, value in (GPU_MODEL if on_gpu() else CPU_MODEL).items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    args = shrink(p.parse_args(), nproc_max=2, iters=3, warmup=1, matmul_size=64,
                  matmul_seconds=0.1, num_layers=2, hidden_size=64, num_attention_heads=2,
                  seq_length=32, vocab_size=128, micro_batch_size=2, global_batch_size=4)
    if args.bf16 is None:
        args.bf16 = on_gpu()
    if args.nproc_max is None:
        args.nproc_max = device_count()
    if args.matmul_size is None:
        args.matmul_size = 8192 if on_gpu() else 2048
    return args


def chosen_layouts(args) -> dict[str, RankGrid]:
    names = args.layouts or [n for k, v in DEFAULT_LAYOUTS.items() if k <= args.nproc_max
                             for n in v]
    layouts = {n: parse_layout(n) for n in ["1"] + [n for n in names if n != "1"]}
    too_big = [n for n, grid in layouts.items() if grid.world_size > args.nproc_max]
    if too_big:
        print(f"skipped (more than --nproc-max {args.nproc_max} processes): {too_big}")
    return {n: grid for n, grid in layouts.items() if grid.world_size <= args.nproc_max}


def describe_machine(args):
    if on_gpu():
        what = f"{device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        what = f"{device_count()} CPU cores, OMP_NUM_THREADS = cores / processes"
    print(f"torch {torch.__version__}; {what}; load average {loadavg()}")
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, seq {args.seq_length}, vocab {args.vocab_size}, "
          f"micro batch {args.micro_batch_size}, global batch {args.global_batch_size}"
          f"{' x processes' if args.scaling == 'weak' else ''}, "
          f"{'bf16' if args.bf16 else 'fp32'}; {args.iters} iterations, first {args.warmup} "
          f"left out; {args.scaling} scaling")


def loadavg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main():
    args = parse_args()
    layouts = chosen_layouts(args)
    describe_machine(args)
    dtype = "bf16" if on_gpu() else "fp32"
    matmul = {}
    for n in sorted({grid.world_size for grid in layouts.values()}):
        matmul[n] = matmul_rate(n, args.matmul_size, args.matmul_seconds)
        print(f"reference: {dtype} matmul {args.matmul_size}^3, {n} process(es) at once: "
              f"{matmul[n] / 1e9:10.1f} GFLOP/s in all ({matmul[n] / matmul[1]:.2f} x 1)")

    rows = []
    for name, grid in layouts.items():
        global_batch = args.global_batch_size * (grid.world_size if args.scaling == "weak" else 1)
        reason = why_not(grid, args, global_batch)
        if reason:
            print(f"skipped {name}: {reason}")
            continue
        before = loadavg()
        start = time.perf_counter()
        result = run_layout(name, grid, args, global_batch)
        result.load_after = os.getloadavg()[0]
        tokens_per_s = global_batch * args.seq_length / (result.ms_per_iter / 1e3)
        rows.append((name, grid, global_batch, result, tokens_per_s))
        print(f"{name}: {result.ms_per_iter:.0f} ms/iter, {tokens_per_s:.0f} tokens/s "
              f"({time.perf_counter() - start:.0f} s; load before {before}, after {loadavg()})",
              flush=True)
    print_table(rows, matmul, args, dtype)


def print_table(rows, matmul, args, dtype):
    base = rows[0][4]
    print(f"\n| layout | processes | micro-batches per DP rank | ms/iter (± sd) | tokens/s "
          f"| tokens/s per process | TFLOP/s per process | tokens/s, fastest iteration "
          f"| {args.scaling} scaling efficiency | matmul bound ({dtype} matmul rate N / 1) "
          f"| load (1 min) at end |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, grid, global_batch, r, tokens_per_s in rows:
        n = grid.world_size
        micro = num_microbatches(global_batch, args.micro_batch_size, grid.data_parallel_size)
        fastest = global_batch * args.seq_length / (r.ms_fastest / 1e3)
        efficiency = tokens_per_s / (n * base)
        print(f"| {name} | {n} | {micro} | {r.ms_per_iter:,.0f} ± {r.ms_stdev:,.0f} "
              f"| {tokens_per_s:,.0f} | {tokens_per_s / n:,.0f} | {r.tflops_per_process:.4g} "
              f"| {fastest:,.0f} | {100 * efficiency:.0f}% | {matmul[n] / matmul[1]:.2f} / {n} "
              f"= {100 * matmul[n] / matmul[1] / n:.0f}% | {r.load_after:.1f} |")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
