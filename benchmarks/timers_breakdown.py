"""Where a TP 2 x PP 2 x DP 2 step's time goes, from megalite's own timers
(--timing-log-level 2 --timing-log-option all): per rank, the step split into compute,
communication (and waiting for peers) and the rest, for the last log interval.

    python benchmarks/timers_breakdown.py [--iters 30] [--nproc 8]

The reference is the step's wall time on the same log line: the top-level phases must add
up to at most it (what they leave is the loop's own bookkeeping). Tensor-parallel
collectives run inside forward-compute and backward-compute and are counted there.

SMOKE=1: 3 iterations (one per log interval), the same 8 ranks and model.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.smoke import shrink
from megalite.spawn import torchrun_command
from megalite.timers import COMMUNICATION, PHASES
from megalite.training_log import parse_log

ROOT = Path(__file__).resolve().parent.parent

LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
MODEL = ["--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "32",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0",
         "--distributed-backend", "gloo"]
COMPUTE = ("batch-generator", "forward-compute", "backward-compute", "optimizer-inner-step")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=8)
    # All 8 ranks even in smoke mode: at DP 1 ZeRO-1 has no params-all-gather to time.
    args = shrink(parser.parse_args(), iters=3)
    command = torchrun_command(args.nproc, "pretrain_gpt.py", [
        *MODEL, *LAYOUT, "--train-iters", str(args.iters), "--log-interval", str(args.iters // 3),
        "--timing-log-level", "2", "--timing-log-option", "all"])
    print("load average before:", os.getloadavg())
    out = subprocess.run(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, check=True).stdout
    print("load average after: ", os.getloadavg())
    step_ms = parse_log(out)[-1]["elapsed_ms"]
    last = out.rsplit("times across ranks (ms):", 1)[1]
    times: dict[str, dict[int, float]] = {}
    for name, block in re.findall(r"^  (\S+):\n((?:     rank +\d+: [\d.]+\n?)+)", last, re.M):
        times[name] = {int(r): float(t) for r, t in re.findall(r"rank +(\d+): ([\d.]+)", block)}
    top = [n for n, (_, parent) in PHASES.items() if parent is None]
    print(f"\nstep (wall, last interval): {step_ms:.1f} ms/iter; per rank, ms/iter:")
    print("| rank | compute | communication | top-level phases | rest of the step |")
    print("|---:|---:|---:|---:|---:|")
    for rank in range(args.nproc):
        def total(names):
            return sum(times.get(n, {}).get(rank, 0.0) for n in names)
        phases = total(top)
        print(f"| {rank} | {total(COMPUTE):.1f} | {total(COMMUNICATION):.1f} | {phases:.1f} "
              f"| {step_ms - phases:.1f} |")
    print("\nmax over ranks (ms/iter):")
    for name in PHASES:
        if name in times:
            print(f"  {name:38s} {max(times[name].values()):8.2f}"
                  f"{'  (communication)' if name in COMMUNICATION else ''}")


if __name__ == "__main__":
    main()
