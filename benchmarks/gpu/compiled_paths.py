"""compiled_paths.py {zero1_overlap|paths} LOG_DIR [--compile-backend NAME] -- FLAGS...:
compiled layers on the paths beside the default run, with torch's own logs as the judge
(TORCH_LOGS=recompiles,graph_breaks: dynamo prints "Recompiling function" and "Graph break"
lines).

zero1_overlap: 8 layers, ZeRO-1 with --overlap-param-gather and --overlap-grad-reduce, a
  bucket per layer or so (--ddp-bucket-size): the param-gather waits must sit outside the
  compiled layer, so no recompile and no graph break.
paths, each against the same run with eager layers (losses within bf16's round-off):
  full recompute (--recompute-granularity full) with compiled layers; the compiled loss
  with eager layers (--cross-entropy-loss-fusion --no-compile-layers); and compiled layers
  under PP 2 (two ranks: two GPUs, as NCCL refuses two ranks on one; on a CPU two gloo
  ranks).
"""

import os
import re
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.runs import GPU, Checks, relative, run_all, run_pretrain, tail
from megalite.training_log import parse_log


LAYERS = ["--num-layers", "8"]
ZERO1 = ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
         "--ddp-bucket-size", "20000"]
LOSS = 2e-2  # compiled kernels fuse (and round) elementwise work differently in bf16
RECOMPILE = re.compile(r"Recompiling function (\S+)")
GRAPH_BREAK = re.compile(r"Graph break", re.IGNORECASE)


def launch(log: str, flags: list[str], backend: str | None, nproc: int = 1) -> tuple[int, str]:
    """run_pretrain.py under torchrun with `nproc` ranks and dynamo's logs on."""
    return run_pretrain(log, flags, nproc=nproc, env={"TORCH_LOGS": "recompiles,graph_breaks"},
                        instruments=("--compile-backend", backend) if backend else ())


def no_recompiles(check: Checks, name: str, output: str):
    recompiled, breaks = RECOMPILE.findall(output), GRAPH_BREAK.findall(output)
    check(f"{name}: compiled once", not recompiled and not breaks,
          f"{len(recompiled)} recompiles {sorted(set(recompiled))[:3]}, {len(breaks)} graph "
          "breaks (TORCH_LOGS=recompiles,graph_breaks)")


def zero1_overlap(check: Checks, log_dir: str, flags: list[str], backend: str | None):
    rc, output = launch(os.path.join(log_dir, "compiled_zero1_overlap.log"),
                        flags + LAYERS + ZERO1 + ["--compile-layers"], backend)
    if check("run compiled_zero1_overlap", rc == 0, "finished" if rc == 0 else f"exit {rc}"):
        no_recompiles(check, "compiled layers with ZeRO-1 overlap", output)
    else:
        print(tail(output))


def paths(check: Checks, log_dir: str, flags: list[str], backend: str | None):
    pp = ["--pipeline-model-parallel-size", "2"]
    cases = {"full_recompute": (["--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"], "--compile-layers"),
             "compiled_loss": (["--no-compile-layers"], "--cross-entropy-loss-fusion"),
             "pipeline": (pp, "--compile-layers")}
    two = not GPU or torch.cuda.device_count() >= 2
    jobs = {}
    for name, (common, compiled) in cases.items():
        if name == "pipeline" and not two:
            print(">> pipeline: compiled layers under PP 2 need two GPUs (NCCL refuses two "
                  "ranks on one): not run")
            continue
        nproc = 2 if name == "pipeline" else 1
        for kind, extra in (("compiled", [compiled]), ("eager", [])):
            eager = ["--no-compile-layers"] if kind == "eager" else []
            log = os.path.join(log_dir, f"compiled_paths.{name}.{kind}.log")
            jobs[f"{name}.{kind}"] = (lambda log=log, f=flags + LAYERS + common + extra + eager,
                                      n=nproc: launch(log, f, backend, n))
    done = run_all(jobs, parallel=2)
    for name, (rc, output) in done.items():
        if not check(f"run {name}", rc == 0, "finished" if rc == 0 else f"exit {rc}"):
            print(tail(output))
    for name in cases:
        if done.get(f"{name}.compiled", (1,))[0] or done.get(f"{name}.eager", (1,))[0]:
            continue
        compiled, eager = done[f"{name}.compiled"][1], done[f"{name}.eager"][1]
        no_recompiles(check, name, compiled)
        pairs = list(zip(parse_log(compiled), parse_log(eager)))
        worst = max((relative(a["lm_loss"], b["lm_loss"]) for a, b in pairs), default=1.0)
        check(f"{name}: compiled vs eager", bool(pairs) and worst <= LOSS,
              f"{len(pairs)} iterations, max relative loss difference {worst:.1e} "
              f"(tol {LOSS:.0e})")


def main():
    mode, log_dir = sys.argv[1], sys.argv[2]
    own = sys.argv[3:sys.argv.index("--")]
    backend = own[own.index("--compile-backend") + 1] if "--compile-backend" in own else None
    flags = sys.argv[sys.argv.index("--") + 1:]
    check = Checks()
    {"zero1_overlap": zero1_overlap, "paths": paths}[mode](check, log_dir, flags, backend)
    check.exit()


if __name__ == "__main__":
    main()
