"""Checkpoints: save and load throughput of megalite's sharded checkpoint of the check's
model, and the projected save time of --project-model-size at this world size (the
planner's parameter count)."""

import glob
import os
import shutil
import time

import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.checkpointing import CheckpointState, load_checkpoint, save_checkpoint
from megalite.checkpointing.state import TrainState
from megalite.cluster_check.report import Section, table
from megalite.cluster_check.shared import ROOT, TARGETS, batch_flags, gathered
from megalite.errors import ConfigError
from megalite.layout_check import build_run
from megalite.memory_estimate import num_model_parameters
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.timers import synchronize
from megalite.validation import validate_model_args

TITLE = "Checkpoints: save and load throughput"


def projected_parameters(size: str) -> tuple[int, str]:
    """The planner's parameter count of examples/configs/*_<size>*.yaml."""
    paths = sorted(glob.glob(os.path.join(ROOT, "examples", "configs",
                                          f"*_{size.lower()}*.yaml")))
    if not paths:
        raise ConfigError(f"--project-model-size {size}: no examples/configs/*_{size.lower()}*"
                          ".yaml")
    args = parse_args(["--yaml-cfg", paths[0], "--vocab-size", "32000",
                       "--micro-batch-size", "1"])
    grid = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    return num_model_parameters(validate_model_args(args, grid)), os.path.basename(paths[0])


def check_checkpoint(model: list[str], args, rank: int, world: int, device) -> Section:
    section = Section(TITLE)
    directory = os.path.join(args.checkpoint_dir or args.output_dir, "check-cluster-ckpt")
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    flags = model + batch_flags(max(4, 2 * world)) + ["--use-distributed-optimizer"]
    config, state, chunks, optimizer, runner, batches = build_run(flags, world, rank, device)
    runner.train_step([next(batches) for _ in range(config.training.num_microbatches)])
    ckpt = CheckpointState(chunks, optimizer, LRScheduler(optimizer, config.scheduler), state,
                           config, TrainState(1, config.training.global_batch_size))
    timings = {}
    for what in ("save", "load"):
        dist.barrier()
        start = time.perf_counter()
        if what == "save":
            published = save_checkpoint(directory, 1, ckpt)
        else:
            load_checkpoint(directory, ckpt)
        synchronize(device)
        dist.barrier()
        timings[what] = time.perf_counter() - start
    nbytes = sum(f.stat().st_size for f in published.rglob("*") if f.is_file())
    params = sum(p.numel() for p in chunks.parameters())
    params = int(sum(gathered(params if state.dp_rank == 0 and state.cp_rank == 0 else 0)))
    size, source = projected_parameters(args.project_model_size)
    bytes_per_param = nbytes / params
    save_rate = nbytes / timings["save"]
    projected = size * bytes_per_param / save_rate
    rows = [[what, f"{nbytes / 1e6:.2f}", f"{seconds:.3f}", f"{nbytes / seconds / 1e9:.3f}",
             f"{nbytes / seconds / world / 1e9:.3f}"] for what, seconds in timings.items()]
    section.lines += [f"megalite's sharded checkpoint of the check's model (ZeRO-1, "
                      f"{params} parameters, {bytes_per_param:.1f} bytes each with Adam's "
                      f"state) written to {directory} by {world} ranks.", ""]
    section.lines += table(["", "MB", "seconds", "GB/s total", "GB/s per rank"], rows)
    verdict = "meets" if projected < TARGETS["13B save (s)"] else "misses"
    section.lines += ["", f"Projected save of the {args.project_model_size} model "
                      f"({size / 1e9:.2f}B parameters, the planner's count of {source}) at "
                      f"{world} ranks: {size * bytes_per_param / 1e9:.0f} GB at the measured "
                      f"{save_rate / 1e9:.3f} GB/s = {projected:.0f} s ({verdict} the "
                      "2-minute target; assumes the rate measured here holds at that size, "
                      "which a small checkpoint understates on fast storage)."]
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return section
