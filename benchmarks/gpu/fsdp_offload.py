"""fsdp_offload.py LOG_DIR -- FLAGS...: FSDP2 with --optimizer-cpu-offload under torchrun
(one process: NCCL refuses two ranks on one GPU) against ZeRO-1, both sharding strategies.

Every run: FLAGS (4 micro-batches, bf16) with --fsdp-grad-reduce-every-micro-batch under
FSDP2, --log-params-norm and --log-num-zeros-in-grad, deterministic kernels. Checked:
- every run finishes, checkpoints written (FSDP2's save gathers the host shards);
- iteration 1 (the same weights, the same forward and the same fp32 gradient sums) equals
  ZeRO-1's; later iterations, where only AdamW's kernel differs (fused on the GPU, foreach
  on the host under offload), and the params norm, within a bf16 step's round-off;
- the straight run saves at half the iterations and at the end; resumed from the first of
  those, bit-exact against the straight run (compare_resume.py: losses, grad norms, every
  tensor of the final checkpoints);
- on a GPU: the offloaded shards in pinned host memory, and the peak GPU memory below the
  same strategy's run without offload.
"""

import os
import shutil
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.gpu.runs import (GPU, Checks, peak_gib, relative, reports, resumed_bit_exact,
                                 run_all, run_pretrain, tail)
from megalite.checkpointing.storage import TRACKER_FILENAME, checkpoint_dir
from megalite.training_log import parse_log


STRATEGIES = ("optim_grads", "optim_grads_params")
LOGGING = ["--log-params-norm", "--log-num-zeros-in-grad", "--log-interval", "1",
           "--eval-iters", "0"]
FSDP = ["--use-torch-fsdp2", "--fsdp-grad-reduce-every-micro-batch"]
OFFLOAD = ["--optimizer-cpu-offload"]
# Iteration 1: the same numbers up to the order of fp32 sums. Later: AdamW's kernels differ
# in the last fp32 bit, which moves a few bf16 weights by one bf16 step.
FIRST_LOSS, FIRST_NORM, LOSS, NORM, PARAMS_NORM = 1e-5, 1e-3, 2e-3, 2e-2, 1e-3


def resume_from(saved: str, iteration: int, resumed: str):
    """`resumed`: a checkpoint directory holding only `saved`'s `iteration`."""
    shutil.copytree(checkpoint_dir(saved, iteration), checkpoint_dir(resumed, iteration))
    with open(os.path.join(resumed, TRACKER_FILENAME), "w") as tracker:
        tracker.write(str(iteration))


def runs(log_dir: str, flags: list[str]) -> dict:
    """{name: (rc, output)}: ZeRO-1 with and without offload, and per strategy FSDP2
    without offload, with offload (saving at half the iterations and at the end), and
    resumed from its checkpoint at half the iterations."""
    iters = int(flags[flags.index("--train-iters") + 1])
    ckpt = os.path.join(log_dir, "ckpt_fsdp_offload")

    def job(name, extra):
        return lambda: run_pretrain(os.path.join(log_dir, f"fsdp_offload.{name}.log"),
                                    flags + LOGGING + extra, nproc=1)
    first = {"zero1": job("zero1", ["--use-distributed-optimizer"]),
             "zero1_offload": job("zero1_offload", ["--use-distributed-optimizer", *OFFLOAD])}
    for s in STRATEGIES:
        strategy = [*FSDP, "--data-parallel-sharding-strategy", s]
        first[s] = job(s, strategy)
        first[f"{s}_offload"] = job(f"{s}_offload", [
            *strategy, *OFFLOAD, "--save", f"{ckpt}/{s}/straight", "--save-interval",
            str(iters // 2)])
    done = run_all(first)
    resumed = {}
    for s in STRATEGIES:
        if done[f"{s}_offload"][0] == 0:
            resume_from(f"{ckpt}/{s}/straight", iters // 2, f"{ckpt}/{s}/resumed")
            resumed[f"{s}_resumed"] = job(f"{s}_resumed", [
                *FSDP, "--data-parallel-sharding-strategy", s, *OFFLOAD, "--save",
                f"{ckpt}/{s}/resumed", "--load", f"{ckpt}/{s}/resumed"])
    return {**done, **run_all(resumed)}


def against_zero1(check: Checks, name: str, rows: list[dict], ref: list[dict]):
    """Per iteration: loss, grad norm, params norm against ZeRO-1's; num zeros present."""
    pairs = list(zip(rows, ref))
    if not check(f"{name}: log lines", len(rows) == len(ref) > 0 and all(
            r["params_norm"] is not None and r["num_zeros"] is not None for r in rows),
            f"{len(rows)} lines (ZeRO-1 {len(ref)}), each with params norm and num zeros"):
        return
    one, one_ref = pairs[0]
    worst = {k: max(relative(a[k], b[k]) for a, b in pairs)
             for k in ("lm_loss", "grad_norm", "params_norm")}
    check(f"{name} vs ZeRO-1", relative(one["lm_loss"], one_ref["lm_loss"]) <= FIRST_LOSS
          and relative(one["grad_norm"], one_ref["grad_norm"]) <= FIRST_NORM
          and worst["lm_loss"] <= LOSS and worst["grad_norm"] <= NORM
          and worst["params_norm"] <= PARAMS_NORM,
          f"iteration 1 loss {one['lm_loss']:.6e} vs {one_ref['lm_loss']:.6e}, grad norm "
          f"{one['grad_norm']} vs {one_ref['grad_norm']}; max relative difference over "
          f"{len(pairs)} iterations: loss {worst['lm_loss']:.1e} (tol {LOSS:.0e}), grad norm "
          f"{worst['grad_norm']:.1e} ({NORM:.0e}), params norm {worst['params_norm']:.1e} "
          f"({PARAMS_NORM:.0e}); num zeros {rows[-1]['num_zeros']:.0f} vs "
          f"{ref[-1]['num_zeros']:.0f}")


def offloaded(check: Checks, name: str, output: str, reference_output: str):
    """The main parameters on the host (pinned on a GPU machine), and less GPU memory."""
    after = reports(output, "optimizer after step 1")
    if not check(f"{name}: shards on the host", bool(after) and after[0]["main_devices"] ==
                 ["cpu"], f"main parameters on {after[0]['main_devices'] if after else '?'}"):
        return
    if not GPU:
        print(f">> {name}: pinned memory and GPU peak not checked on the CPU")
        return
    check(f"{name}: pinned", after[0]["pinned_host_mains"] == after[0]["host_mains"] > 0,
          f"{after[0]['pinned_host_mains']} of {after[0]['host_mains']} host shards pinned")
    peak, without = peak_gib(output), peak_gib(reference_output)
    check(f"{name}: GPU memory", None not in (peak, without) and peak < without,
          f"peak allocated {peak} GiB, {without} GiB without offload")


def main():
    log_dir, flags = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    check = Checks()
    done = runs(log_dir, flags)
    for name, (rc, output) in done.items():
        if not check(f"run {name}", rc == 0, "finished" if rc == 0 else f"exit {rc}"):
            print(tail(output))
    if done["zero1"][0] != 0:
        check.exit()
    ref = parse_log(done["zero1"][1])
    for name in ("zero1_offload", *STRATEGIES, *(f"{s}_offload" for s in STRATEGIES)):
        if done[name][0] == 0:
            against_zero1(check, name, parse_log(done[name][1]), ref)
    if done["zero1_offload"][0] == 0:
        offloaded(check, "zero1_offload", done["zero1_offload"][1], done["zero1"][1])
    for s in STRATEGIES:
        if done[f"{s}_offload"][0] == 0 and done[s][0] == 0:
            offloaded(check, f"{s}_offload", done[f"{s}_offload"][1], done[s][1])
        if done.get(f"{s}_resumed", (1,))[0] == 0 and done[f"{s}_offload"][0] == 0:
            ckpt = os.path.join(log_dir, "ckpt_fsdp_offload", s)
            resumed_bit_exact(check, f"{s}_offload",
                              tuple(os.path.join(log_dir, f"fsdp_offload.{s}_{r}.log")
                                    for r in ("offload", "resumed")),
                              (f"{ckpt}/straight", f"{ckpt}/resumed"))
    check.exit()


if __name__ == "__main__":
    main()
