"""megatron_load.py LOG_DIR -- FLAGS...: a Megatron-LM checkpoint written by megalite's own
exporter, loaded with pretrain's --load on this device with each optimizer, against a load
of the same checkpoint on the CPU.

The checkpoint: FLAGS trained for a few iterations (so its loss is far from a fresh
model's and a wrong weight shows), saved, exported by tools/convert_checkpoint.py
--export-megatron (legacy torch format), and given Adam's state as Megatron's FP32Optimizer
saves it (torch AdamW's state_dict over Megatron's parameter groups, one step), so the load
carries the optimizer over. Loads, one iteration each: the CPU (gloo, fp32: the
reference); on the GPU in bf16 plain (fp32 main copies), ZeRO-1, ZeRO-1 + offload and FSDP2.
Checked: the iteration after the saved one comes first, its loss equals the CPU load's
within bf16's rounding step (and the bf16 loads' losses each other's), Adam's state was
carried over, and before the first step every main parameter has its state, on the main
parameter's device (the host under offload).
"""

import os
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.runs import (GPU, REPO, Checks, relative, reports, run_all, run_pretrain,
                                 run_script, tail)
from megalite.atomic_write import atomic_path
from megalite.megatron_checkpoint.optimizer_state import megatron_param_groups
from megalite.megatron_checkpoint.reader import LEGACY_FILE, iteration_dir, legacy_rank_dir
from megalite.megatron_checkpoint.safe_pickle import torch_load
from megalite.training_log import parse_log

BF16_STEP = 2 ** -7  # bf16's relative rounding step (8 significant bits)
SAME_WEIGHTS = 1e-5  # bf16 loads against each other: the order of fp32 sums at most
SOURCE_ITERS = 12
LOADS = {"cpu": ["--distributed-backend", "gloo"],  # fp32 on the host: the reference
         "plain": ["--bf16"], "zero1": ["--bf16", "--use-distributed-optimizer"],
         "zero1_offload": ["--bf16", "--use-distributed-optimizer", "--optimizer-cpu-offload"],
         "fsdp2": ["--bf16", "--use-torch-fsdp2"]}


def add_adam_state(megatron_dir: str) -> int:
    """Adam's state, as Megatron's FP32Optimizer saves it, into the exported file; returns
    Adam's step."""
    _, directory = iteration_dir(megatron_dir)
    path = directory / legacy_rank_dir(0, 0, 1) / LEGACY_FILE
    record = torch_load(path, str(path))
    params = {n: torch.nn.Parameter(t.float().clone()) for n, t in record["model"].items()
              if torch.is_tensor(t)}
    groups = megatron_param_groups(list(params), {n: p.shape for n, p in params.items()})
    adam = torch.optim.AdamW([{"params": [params[n] for n in g]} for g in groups], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=generator)
    adam.step()
    # A new file renamed over the old: `record`'s tensors are memory-mapped from the old one,
    # and writing it in place would truncate them under the save (SIGBUS).
    with atomic_path(path) as staging:
        torch.save({**record, "optimizer": adam.state_dict()}, staging)
    return 1


def source(log_dir: str, flags: list[str], check: Checks) -> tuple[str, list[float]] | None:
    """The exported Megatron directory and the source run's losses, iteration by iteration
    (the first is a fresh model's)."""
    ckpt, megatron = os.path.join(log_dir, "ckpt_megatron_src"), os.path.join(
        log_dir, "ckpt_megatron")
    rc, out = run_pretrain(os.path.join(log_dir, "megatron_load.source.log"), flags + [
        "--bf16", "--lr", "1e-2", "--train-iters", str(SOURCE_ITERS), "--log-interval", "1",
        "--save", ckpt])
    if not check("source run", rc == 0 and bool(parse_log(out)), f"exit {rc}"):
        print(tail(out))
        return None
    log = os.path.join(log_dir, "megatron_load.export.log")
    rc = run_script(log, os.path.join(REPO, "tools", "convert_checkpoint.py"), [
        "--load", ckpt, "--export-megatron", megatron, "--ckpt-format", "torch"])
    if not check("export (tools/convert_checkpoint.py --export-megatron)", rc == 0,
                 f"exit {rc}"):
        print(tail(open(log, errors="replace").read()))
        return None
    add_adam_state(megatron)
    return megatron, [row["lm_loss"] for row in parse_log(out)]


def main():
    log_dir, flags = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    check = Checks()
    made = source(log_dir, flags, check)
    if made is None:
        check.exit()
    megatron, trained = made
    done = run_all({name: (lambda name=name, extra=extra: run_pretrain(
        os.path.join(log_dir, f"megatron_load.{name}.log"), flags + extra + [
            "--load", megatron, "--train-iters", str(SOURCE_ITERS + 1), "--log-interval",
            "1"])) for name, extra in LOADS.items()})
    first = {}
    for name, (rc, out) in done.items():
        rows = parse_log(out)
        if not check(f"{name}: load and one iteration", rc == 0 and bool(rows)
                     and rows[0]["iteration"] == SOURCE_ITERS + 1
                     and "Adam state carried over (step 1)" in out,
                     f"exit {rc}, first iteration {rows[0]['iteration'] if rows else None} "
                     f"(expected {SOURCE_ITERS + 1}), Adam state "
                     f"{'carried over' if 'Adam state carried over' in out else 'NOT loaded'}"):
            print(tail(out))
            continue
        first[name] = rows[0]["lm_loss"]
        before = reports(out, "optimizer before step 1")[0]
        expected = "cpu" if name in ("cpu", "zero1_offload") or not GPU else "cuda"
        check(f"{name}: optimizer state", before["mains_with_state"] == before["mains"] > 0
              and before["state_off_device"] == 0 and before["main_devices"] == [expected],
              f"{before['mains_with_state']} of {before['mains']} main parameters with "
              f"loaded state, main parameters on {before['main_devices']} (expected "
              f"{expected}), model on {before['param_devices']}, state tensors elsewhere: "
              f"{before['state_off_device']}")
    if "cpu" in first:
        check("the CPU load is the trained model, not a fresh one",
              abs(first["cpu"] - trained[-1]) < abs(first["cpu"] - trained[0]),
              f"iteration {SOURCE_ITERS + 1} loss {first['cpu']:.4f}; the source's losses "
              f"{trained[0]:.4f} (fresh) .. {trained[-1]:.4f}")
        for name, loss in first.items():
            if name != "cpu":
                off = relative(loss, first["cpu"])
                check(f"{name}: loss vs the CPU load", off <= BF16_STEP, f"{loss:.6e} vs "
                      f"{first['cpu']:.6e} (relative {off:.1e}, tol {BF16_STEP:.1e})")
    if "plain" in first:  # the same bf16 weights and forward whatever the optimizer
        spread = max(relative(loss, first["plain"]) for n, loss in first.items() if n != "cpu")
        check("bf16 loads agree", spread <= SAME_WEIGHTS, f"max relative difference from the "
              f"plain load {spread:.1e} (tol {SAME_WEIGHTS:.0e})")
    check.exit()


if __name__ == "__main__":
    main()
