"""How long a save blocks training: synchronous save_checkpoint against --async-save's
snapshot (async_save.AsyncCheckpointer), in the same run, on the same model and disk.

One process (a one-rank gloo group, or NCCL with --device cuda) builds the GPT of
benchmarks/checkpoint_throughput.py (fp32, plain AdamW), takes a training step so Adam's
moments exist, then per round:
  sync   save_checkpoint: the whole save blocks training (seconds, GB/s written);
         each time also in the CPU seconds of the training thread (time.thread_time),
         which other processes on a busy machine do not inflate;
  async  AsyncCheckpointer.save, then training steps while the snapshot is copied and the
         writer thread writes, then finalize(blocking=True): the save's whole duration.
         The stall: the request plus what the next optimizer step waited for the copies
         (CPU seconds: the request's only; the first round allocates the host buffers,
         later rounds reuse them);
  steps  the same training steps with no save in flight: what the writer thread costs a
         step that runs beside it (the GIL and the cores it shares).
The files of the sync and async saves are checked byte-identical. Prints the stall as a
fraction of the sync save (the target: <= 10%).

    python benchmarks/async_save_stall.py [--num-layers 8 --hidden-size 768 --repeat 3]

SMOKE=1 (benchmarks/common/smoke.py): a 2-layer hidden-64 model, two rounds, under $TMPDIR.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.checkpoint_run import Run, add_run_args, build_config, init_one_rank
from benchmarks.common.smoke import shrink
from megalite.checkpointing.async_save import AsyncCheckpointer
from megalite.parallel_state import ParallelState


def timed(fn, *args) -> tuple[float, float, object]:
    """(wall seconds, this thread's CPU seconds, result) of fn(*args)."""
    start, cpu = time.perf_counter(), time.thread_time()
    result = fn(*args)
    return time.perf_counter() - start, time.thread_time() - cpu, result


def steps(run: Run, n: int) -> float:
    """Seconds per training step over `n` steps."""
    start = time.perf_counter()
    for _ in range(n):
        run.train_step()
    return (time.perf_counter() - start) / n


def async_round(run: Run, writer: AsyncCheckpointer, directory: str, iteration: int,
                n_steps: int) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    stall, stall_cpu, _ = timed(writer.save, directory, iteration, run.checkpoint(iteration))
    writer.waited_s = 0.0
    step_s = steps(run, n_steps)  # beside the writer
    writer.finalize(blocking=True)
    # Blocked: the request, and the optimizer steps' wait for the snapshot's copies.
    return {"stall": stall + writer.waited_s, "stall_cpu": stall_cpu,
            "total": time.perf_counter() - start, "step": step_s}


def same_bytes(a: Path, b: Path) -> bool:
    return all((a / f.name).read_bytes() == f.read_bytes()
               for f in b.iterdir() if f.suffix == ".pt")


def measure(args, run: Run, tmp: str) -> list[dict]:
    writer = AsyncCheckpointer(run.device, dist.group.WORLD)
    rounds = []
    for r in range(args.repeat):
        sync_dir, async_dir = os.path.join(tmp, "sync"), os.path.join(tmp, "async")
        shutil.rmtree(sync_dir, ignore_errors=True)
        sync_s, sync_cpu, final = timed(run.save, sync_dir, 1)
        nbytes = sum(f.stat().st_size for f in final.iterdir())
        # The same state as the sync save: async saves iteration 1 before any step.
        row = async_round(run, writer, async_dir, 1, args.steps)
        assert same_bytes(final, Path(async_dir, final.name)), "async files differ from sync"
        row.update(sync=sync_s, sync_cpu=sync_cpu, bytes=nbytes, alone=steps(run, args.steps), round=r + 1,
                   host_buffers=writer.buffers.nbytes)
        rounds.append(row)
    return rounds


def report(rows: list[dict]):
    print("\n| round | bytes | sync save s (CPU s) | sync GB/s | async stall s (CPU s) "
          "| stall / sync, wall (CPU) | async save, whole s | step s beside the writer "
          "| step s alone |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['round']} | {r['bytes']:,} | {r['sync']:.2f} ({r['sync_cpu']:.2f}) | "
              f"{r['bytes'] / r['sync'] / 1e9:.2f} | {r['stall']:.3f} ({r['stall_cpu']:.3f}) | "
              f"{100 * r['stall'] / r['sync']:.1f}% ({100 * r['stall_cpu'] / r['sync_cpu']:.1f}%)"
              f" | {r['total']:.2f} | {r['step']:.3f} | {r['alone']:.3f} |")
    later = rows[1:] or rows
    ratios = sorted(r["stall"] / r["sync"] for r in later)
    cpu = sorted(r["stall_cpu"] / r["sync_cpu"] for r in later)
    print(f"host buffers held between saves: {rows[-1]['host_buffers']:,} bytes")
    print(f"stall with reused buffers (rounds {later[0]['round']}..{later[-1]['round']}): "
          f"median {100 * ratios[len(ratios) // 2]:.1f}%, max {100 * ratios[-1]:.1f}% of the "
          f"synchronous save of the same round (target <= 10%); in this thread's CPU "
          f"seconds, which a busy machine's other processes do not inflate: median "
          f"{100 * cpu[len(cpu) // 2]:.1f}%, max {100 * cpu[-1]:.1f}%")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--repeat", type=int, default=3, help="Rounds (the first allocates the "
                   "host buffers, later ones reuse them).")
    p.add_argument("--steps", type=int, default=3,
                   help="Training steps (b=1, s=32) run while the writer writes.")
    args = shrink(p.parse_args(), dir=tempfile.gettempdir(), num_layers=2, hidden_size=64,
                  vocab_size=512, repeat=2, steps=1)
    device = init_one_rank(args.device)
    try:
        with tempfile.TemporaryDirectory(prefix="async_bench_", dir=args.dir) as tmp:
            config = build_config(args, os.path.join(tmp, "sync"))
            run = Run(config, ParallelState(config.parallel.grid, 0), device)
            run.train_step()
            psi = sum(q.numel() for q in run.model.parameters())
            print(f"torch {torch.__version__}, {os.cpu_count()} cores, model on {device}: "
                  f"{args.num_layers} layers, hidden {args.hidden_size}, "
                  f"{psi / 1e6:.2f}M fp32 parameters, plain AdamW; directory {tmp}")
            rows = measure(args, run, tmp)
    finally:
        dist.destroy_process_group()
    report(rows)


if __name__ == "__main__":
    main()
