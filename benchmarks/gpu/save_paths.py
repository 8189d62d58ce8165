"""save_paths.py LOG_DIR -- FLAGS...: the save paths beside the synchronous one, each saved
at half the iterations and resumed, bit-exact against the straight run (compare_resume.py:
losses, grad norms, every tensor of the final checkpoints), deterministic kernels:
- async: --async-save (the side-stream snapshot to pinned memory, the background writer);
- async_offload, async_zero1_offload: --async-save with --optimizer-cpu-offload under FSDP2
  (torchrun) and under ZeRO-1: host optimizer state in the snapshot;
- async_moe: --async-save with an MoE layer and --moe-router-enable-expert-bias (the bias
  updated after the backward, snapshotted with the step it belongs to);
- local: --non-persistent-ckpt-type local saves every iteration, the first run killed as
  step half + 1 starts (no persistent save yet), the resume reads the local save;
- cpu_written (on a GPU): the first half run on the CPU (CUDA_VISIBLE_DEVICES=""), resumed on
  the GPU: it must resume (the device RNG of another device kind is not restored), and its
  losses follow the straight GPU run's within TF32's round-off.
"""

import os
import shutil
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.gpu.runs import (GPU, Checks, relative, resumed_bit_exact, run_all,
                                 run_pretrain, tail)
from megalite.checkpointing.storage import TRACKER_FILENAME, checkpoint_dir
from megalite.training_log import parse_log


MOE = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
       "--moe-router-load-balancing-type", "none"]
FSDP_OFFLOAD = ["--use-torch-fsdp2", "--optimizer-cpu-offload"]
ZERO1_OFFLOAD = ["--use-distributed-optimizer", "--optimizer-cpu-offload"]
ASYNC = ["--async-save"]
CPU_TOLERANCE = 2e-2  # a CPU's fp32 against the GPU's TF32 matmuls, a few steps on


def resume_from(saved: str, iteration: int, resumed: str):
    """`resumed`: a checkpoint directory holding only `saved`'s `iteration`."""
    shutil.copytree(checkpoint_dir(saved, iteration), checkpoint_dir(resumed, iteration))
    with open(os.path.join(resumed, TRACKER_FILENAME), "w") as tracker:
        tracker.write(str(iteration))


def main():
    log_dir, flags = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    iters = int(flags[flags.index("--train-iters") + 1])
    half = iters // 2
    check = Checks()
    ckpt = {name: os.path.join(log_dir, f"ckpt_{name}")
            for name in ("async", "async_offload", "async_zero1_offload", "async_moe", "local",
                         "cpu_written")}
    log = {}

    def job(name, extra, nproc=0, env=None, die_at=None):
        log[name] = os.path.join(log_dir, f"save_paths.{name}.log")
        instruments = ("--deterministic", *(("--die-at-step", str(die_at)) if die_at else ()))
        return lambda: run_pretrain(log[name], flags + extra, nproc=nproc, env=env,
                                    instruments=instruments)

    halves = ["--save-interval", str(half)]
    extras = {"async": ASYNC, "async_offload": ASYNC + FSDP_OFFLOAD,
              "async_zero1_offload": ASYNC + ZERO1_OFFLOAD, "async_moe": ASYNC + MOE}
    first = {f"{n}.straight": job(f"{n}.straight", e + halves + ["--save", f"{ckpt[n]}/straight"],
                                  nproc=int(n == "async_offload")) for n, e in extras.items()}
    local = ["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type",
             "local", "--non-persistent-local-ckpt-dir", f"{ckpt['local']}/local"]
    first["local.straight"] = job("local.straight", ["--save", f"{ckpt['local']}/straight"])
    first["local.first"] = job("local.first", local + [
        "--save", f"{ckpt['local']}/first", "--save-interval", str(iters)], die_at=half + 1)
    if GPU:
        first["cpu_written.straight"] = job("cpu_written.straight", [])
        first["cpu_written.first"] = job(  # CUDA_VISIBLE_DEVICES="": torch sees no GPU
            "cpu_written.first", ["--save", ckpt["cpu_written"], "--exit-interval", str(half),
                                  "--distributed-backend", "gloo"],
            env={"CUDA_VISIBLE_DEVICES": ""})
    done = run_all(first)
    second = {}
    for n, e in extras.items():
        if done[f"{n}.straight"][0] == 0:
            resume_from(f"{ckpt[n]}/straight", half, f"{ckpt[n]}/resumed")
            second[f"{n}.resumed"] = job(f"{n}.resumed", e + [
                "--save", f"{ckpt[n]}/resumed", "--load", f"{ckpt[n]}/resumed"],
                nproc=int(n == "async_offload"))
    rc, output = done["local.first"]  # killed (137): its local saves are all it left
    done["local.first"] = (0 if rc == 137 else rc or "0, not killed", output)
    if rc == 137:
        second["local.resumed"] = job("local.resumed", local + [
            "--save", f"{ckpt['local']}/resumed", "--load", f"{ckpt['local']}/first"])
    if GPU and done["cpu_written.first"][0] == 0:
        second["cpu_written.resumed"] = job("cpu_written.resumed", ["--load", ckpt["cpu_written"]])
    done.update(run_all(second))
    for name, (rc, output) in done.items():
        if not check(f"run {name}", rc == 0, "finished" if rc == 0 else f"exit {rc}"):
            print(tail(output))
    for n in (*extras, "local"):
        if done.get(f"{n}.resumed", (1,))[0] == 0:
            resumed_bit_exact(check, n, (log[f"{n}.straight"], log[f"{n}.resumed"]),
                              (f"{ckpt[n]}/straight", f"{ckpt[n]}/resumed"))
    if not GPU:
        print(">> cpu_written: a CPU-written checkpoint resumed on a GPU needs a GPU")
    elif done.get("cpu_written.resumed", (1,))[0] == 0:
        output = done["cpu_written.resumed"][1]
        straight = {r["iteration"]: r["lm_loss"]
                    for r in parse_log(done["cpu_written.straight"][1])}
        resumed = {r["iteration"]: r["lm_loss"] for r in parse_log(output)}
        common = sorted(set(straight) & set(resumed))
        worst = max((relative(resumed[i], straight[i]) for i in common), default=1.0)
        check("cpu_written: resumed on the GPU", "resuming from" in output and common
              and worst <= CPU_TOLERANCE, f"iterations {common}: max relative loss difference "
              f"{worst:.1e} against the straight GPU run (tol {CPU_TOLERANCE:.0e})")
    check.exit()


if __name__ == "__main__":
    main()
