"""fp8_paths.py LOG_DIR [--compile-backend NAME] -- FLAGS...: the FP8 paths beside the fp8
step's compiled tensorwise run, each against the same model in bf16 (losses within FP8's
round-off over a few steps):
- rowwise: --fp8-recipe rowwise (a scale per row, cuBLASLt's rowwise-scaled GEMM);
- eager: --fp8-format hybrid with eager layers, 4 micro-batches a step: the weights'
  FP8 copies cached for the step and reused by every micro-batch;
- recompute: --fp8-format hybrid with full recompute (the recomputed forward quantizes
  again, with the step's cached weights);
and the zero-bubble W pass on FP8 linears (zero_bubble.py --fp8: F F B B W W bit-equal to
one backward per micro-batch). FP8 needs a GPU of compute capability 8.9 or more (Ada,
Hopper, Blackwell); on a CPU the same code runs on torch's CPU kernels under SMOKE.
"""

import os
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.runs import (GPU, HELPERS, Checks, relative, run_all, run_pretrain,
                                 run_script, tail)
from megalite.training_log import parse_log


CASES = {"rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
         "eager": ["--fp8-format", "hybrid", "--no-compile-layers", "--micro-batch-size", "1"],
         "recompute": ["--fp8-format", "hybrid", "--recompute-granularity", "full",
                       "--recompute-method", "uniform", "--recompute-num-layers", "1"]}
LOSS = 5e-2  # FP8's e4m3 operands (3 mantissa bits) against bf16's, a few steps in


def main():
    log_dir = sys.argv[1]
    own = sys.argv[2:sys.argv.index("--")]
    flags = sys.argv[sys.argv.index("--") + 1:]
    check = Checks()
    if GPU and torch.cuda.get_device_capability() < (8, 9):
        print("SKIP: FP8 needs compute capability 8.9 or more; this GPU has "
              f"{torch.cuda.get_device_capability()}")
        sys.exit(99)
    instruments = ("--deterministic", *own)
    jobs = {}
    for name, extra in {"bf16": [], **CASES}.items():
        log = os.path.join(log_dir, f"fp8_paths.{name}.log")
        jobs[name] = lambda log=log, f=flags + extra: run_pretrain(log, f, instruments=instruments)
    done = run_all(jobs)
    for name, (rc, output) in done.items():
        if not check(f"run {name}", rc == 0, "finished" if rc == 0 else f"exit {rc}"):
            print(tail(output))
    if done["bf16"][0] == 0:
        reference = parse_log(done["bf16"][1])
        for name in CASES:
            if done[name][0]:
                continue
            pairs = list(zip(parse_log(done[name][1]), reference))
            worst = max((relative(a["lm_loss"], b["lm_loss"]) for a, b in pairs), default=1.0)
            check(f"{name} vs bf16", bool(pairs) and worst <= LOSS,
                  f"{len(pairs)} iterations, max relative loss difference {worst:.1e} "
                  f"(tol {LOSS:.0e})")
    log = os.path.join(log_dir, "fp8_paths.zero_bubble.log")
    rc = run_script(log, os.path.join(HELPERS, "zero_bubble.py"), ["--fp8"])
    print(open(log, errors="replace").read(), end="", flush=True)
    check("zero-bubble W pass with FP8 linears", rc == 0, "the lines above")
    check.exit()


if __name__ == "__main__":
    main()
