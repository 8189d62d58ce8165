"""Prove megalite on this cluster (issue 25; docs/design.md §13): every layout against one
process over the real backend, collective bandwidth, weak scaling, checkpoint throughput,
a killed rank's recovery, and (--tune) the fastest layout for a model. Run it the way training runs:

    torchrun --nproc-per-node 8 tools/check_cluster.py --output-dir cluster-report
    srun --ntasks-per-node 8 ... torchrun ... tools/check_cluster.py --output-dir ... --tune

On GPUs it uses NCCL, on CPUs gloo (--distributed-backend as in pretrain_gpt.py). Rank 0
writes REPORT.md (and PNG charts when matplotlib, the `plot` extra, is installed) to
--output-dir. Exit status 1 when a layout differs from one process or the killed rank's job
does not resume; the measurements are reported against the exercise's targets but never
fail the check. docs/troubleshooting.md says what each failure means.

This file is the command line; the phases (correctness, collectives, scaling, checkpoint,
recovery, --tune) and the report are megalite/cluster_check/, a module each.

Every flag it does not know is pretrain_gpt.py's and changes the model it checks (the
default is a 4-layer hidden-64 GPT small enough for a CPU: cluster_check/checks.MODEL).
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.atomic_write import unwritable_directory
from megalite.cluster_check.checks import CHECKS, MODEL, run_checks
from megalite.cluster_check.correctness import check_layout_patterns
from megalite.cluster_check.report import publish
from megalite.config import DistributedConfig
from megalite.errors import ConfigError, MegaliteError
from megalite.initialize import initialize_distributed, world_size_from_env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="Every other flag is pretrain_gpt.py's.")
    parser.add_argument("--output-dir", required=True, help="Where REPORT.md goes.")
    parser.add_argument("--checks", nargs="+", default=CHECKS, choices=CHECKS)
    parser.add_argument("--layouts", nargs="+", default=None, metavar="NAME",
                        help="Check only these layouts, by the name the report gives them; "
                        "shell wildcards select several (\"TP2*\").")
    parser.add_argument("--steps", type=int, default=2,
                        help="Steps per layout (default 2: the second catches state carried "
                        "between steps).")
    parser.add_argument("--bf16-check", choices=["auto", "on", "off"], default="auto",
                        help="Also check every layout in bf16 (auto: on GPUs).")
    parser.add_argument("--message-sizes", nargs="+", type=float, default=None,
                        metavar="MIB", help="Collective sizes in MiB (default: the sizes "
                        "the checked and tuned layouts send).")
    parser.add_argument("--timed-steps", type=int, default=3,
                        help="Steps timed per world size and per tuned layout (default 3).")
    parser.add_argument("--project-model-size", default="13B",
                        help="Model whose save time to project (examples/configs/*_<size>*).")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="Where to write the test checkpoint (default: --output-dir).")
    parser.add_argument("--tune", action="store_true",
                        help="Time the layouts the memory planner says fit, pruned by the "
                        "measured bandwidth.")
    parser.add_argument("--tune-micro-batch-sizes", nargs="+", type=int, default=[1, 2, 4],
                        metavar="N", help="Micro-batch sizes --tune tries (default 1 2 4).")
    parser.add_argument("--tune-max", type=int, default=6,
                        help="Layouts --tune times besides the default (default 6).")
    parser.add_argument("--memory-fraction", type=float, default=0.9,
                        help="--tune plans against this fraction of a rank's memory (default "
                        "0.9): the CUDA context, NCCL's buffers and the allocator's "
                        "fragmentation take the rest, and the memory planner counts none of "
                        "them. A layout that runs out of memory all the same is reported as "
                        "such and the tuning goes on (megalite's own flag).")
    parser.add_argument("--recovery-nproc", type=int, default=None,
                        help="Workers of the recovery check's own torchrun (default: 2, or "
                        "the node's ranks if fewer).")
    parser.add_argument("--recovery-limit", type=float, default=360.0,
                        help="Seconds the recovery check waits for a checkpoint, and then "
                        "for the resumed step (default 360).")
    return parser


def main(argv=None) -> int:
    args, model_flags = build_parser().parse_known_args(argv)
    model = MODEL + model_flags
    try:
        check_flags(args, world_size_from_env())
        backend = parse_args(model).distributed_backend
        rank, world, device = initialize_distributed(DistributedConfig(backend=backend))
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The fp32 contract is fp32: no TF32 matmuls on the GPU.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    started = time.time()
    try:
        sections, charts = run_checks(model, args, rank, world, device)
    except MegaliteError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        publish(args.output_dir, sections, charts,
                f"{world} ranks, backend {dist.get_backend()}, device {device.type}, "
                f"torch {torch.__version__}; {time.time() - started:.0f} s.")
    dist.destroy_process_group()
    return 1 if any(s.failed for s in sections) else 0


def check_flags(args, world: int):
    """Before any check runs (and before start-up): the flags, the layouts they select and
    the directories the report and checkpoints go to."""
    for flag in ("steps", "timed_steps", "tune_max", "recovery_nproc", "recovery_limit"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if min(args.tune_micro_batch_sizes) <= 0:
        raise ConfigError(f"--tune-micro-batch-sizes must be positive, got "
                          f"{args.tune_micro_batch_sizes}")
    if args.message_sizes and min(args.message_sizes) <= 0:
        raise ConfigError(f"--message-sizes must be positive, got {args.message_sizes}")
    if not 0 < args.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    check_layout_patterns(args.layouts, world)
    for flag in ("output_dir", "checkpoint_dir"):
        path = getattr(args, flag)
        problem = path is not None and unwritable_directory(path)
        if problem:
            raise ConfigError(f"--{flag.replace('_', '-')} {path}: {problem}")


if __name__ == "__main__":
    sys.exit(main())
