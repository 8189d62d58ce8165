"""Prove megalite on this cluster (issue 25; docs/design.md §13): every layout against one
process over the real backend, collective bandwidth, weak scaling, checkpoint throughput,
a killed rank's recovery, and (--tune) the fastest layout for a model. Run it the way training runs:

    torchrun --nproc-per-node 8 tools/check_cluster.py --output-dir cluster-report
    srun --ntasks-per-node 8 ... torchrun ... tools/check_cluster.py --output-dir ... --tune

On GPUs it uses NCCL, on CPUs gloo (--distributed-backend as in pretrain_gpt.py). Rank 0
writes REPORT.md (and PNG charts when matplotlib, the `plot` extra, is installed) to
--output-dir. Exit status 1 when a layout differs from one process or the killed rank's job
does not resume; the measurements are reported against the exercise's targets but never
fail the check. docs/troubleshooting.md
says what each failure means.

1. Correctness: each layout of megalite/layout_check.layouts_for(world size), filling the
   launch with DP (a layout smaller than the launch is checked inside the product that
   fills it, not on a subset), against one process of the same model on rank 0's device:
   the initial values exactly, then per step the loss and grad norm (and the values after
   the update) in fp32 to the contract's tolerance; on GPUs also in bf16, to a stated bound.
2. Collectives: bus bandwidth of all-reduce, all-gather, reduce-scatter and paired p2p at
   the sizes the checked and tuned layouts send (megalite/layout_tune.step_traffic) or
   --message-sizes, within a node and, with several nodes, across them (nccl-tests' busbw).
3. Scaling: weak scaling of the DP layout on the first 1, 2, 4, ... ranks and all of them.
4. Checkpoints: save and load throughput of megalite's checkpoints, and the projected save
   time of --project-model-size at this world size (the planner's parameter count).
   Recovery: rank 0 runs a torchrun of its own with --max-restarts 1, SIGKILLs one of its
   workers after a checkpoint, and times from the kill to the first resumed step.
5. --tune: the layouts the memory planner says fit (--memory-fraction of a rank's memory),
   pruned by an estimate from the measured bandwidth (megalite/layout_tune.py), the best few
   timed against the default, by tokens/s, each in processes of its own
   (megalite/layout_trial.py): a layout that runs out of memory on a rank is reported as such.

Every flag it does not know is pretrain_gpt.py's and changes the model it checks (the
default is a 4-layer hidden-64 GPT small enough for a CPU).
"""

import argparse
import contextlib
import fnmatch
import glob
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.atomic_write import unwritable_directory
from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.checkpointing.state import CheckpointState, TrainState
from megalite.checkpointing.storage import TRACKER_FILENAME
from megalite.config import DistributedConfig
from megalite.errors import ConfigError, MegaliteError
from megalite.initialize import initialize_distributed, world_size_from_env
from megalite.layout_check import (BF16, FP32, build_run, first_difference, layouts_for,
                                   run_layout)
from megalite.layout_trial import Trial, time_layout
from megalite.layout_tune import (Candidate, Estimate, algorithm_factor, candidates,
                                  communication_seconds, compute_seconds, nearest_bandwidth,
                                  planned_bytes, prune_by_bandwidth,
                                  step_traffic)
from megalite.memory_estimate import GiB, most_loaded_rank, num_model_parameters
from megalite.monitoring.peak_flops import compute_dtype, peak_tflops
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.parallel_state import all_gather_into, reduce_scatter_into
from megalite.spawn import torchrun_workers
from megalite.training_log import num_floating_point_operations
from megalite.validation import validate_args, validate_model_args

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# A GPT small enough for a CPU that still has every axis to split: 8 heads in 4 query
# groups (TP up to 4), 4 layers (PP up to 4, or 2 x 2 virtual), 32 tokens (CP up to 4
# with SP), an odd vocabulary (TP pads it). fp32, dropout 0: the contract's conditions.
# No biases and Adam's eps at 1e-4: Adam divides a gradient by its own RMS, so with the
# default 1e-8 a gradient that is zero in exact arithmetic (the K bias) or nearly so turns
# its round-off into a step of up to lr, and values after an update differ by ~lr, as a
# layout bug would make them.
MODEL = ["--mock-data", "--vocab-size", "61", "--make-vocab-size-divisible-by", "1",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--swiglu",
         "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--seq-length", "32",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "3e-3",
         "--disable-bias-linear", "--adam-eps", "1e-4",
         "--weight-decay", "0.1", "--clip-grad", "0.5", "--seed", "1234",
         "--train-iters", "1000", "--num-workers", "0"]
TARGETS = {"scaling to 8": 0.9, "scaling at 32": 0.8, "13B save (s)": 120.0,
           "recovery (s)": 300.0}
CHECKS = ["correctness", "collectives", "scaling", "checkpoint", "recovery"]


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


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    failed: bool = False
    seconds: float | None = None


# ------------------------------------------------------------------ helpers

def print0(message: str):
    if dist.get_rank() == 0:
        print(message, flush=True)


def sync(device: torch.device):
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def batch_flags(global_batch: int, micro: int = 1) -> list[str]:
    return ["--micro-batch-size", str(micro), "--global-batch-size", str(global_batch)]


def gathered(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


# ------------------------------------------------------------------ 1. correctness

def selected(layout, args) -> bool:
    return not args.layouts or any(fnmatch.fnmatchcase(layout.name, pattern)
                                   for pattern in args.layouts)


def check_layout_patterns(patterns: list[str] | None, world: int):
    """Each --layouts pattern names a layout: a typo would check nothing, and pass."""
    names = [layout.name for layout in layouts_for(world)]
    unmatched = [p for p in patterns or ()
                 if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    if unmatched:
        raise ConfigError(f"--layouts {' '.join(map(repr, unmatched))} matches no layout at "
                          f"world size {world} (names are case-sensitive); the layouts are: "
                          + ", ".join(map(repr, names)))


def checked_configs(model: list[str], args, world: int) -> list:
    """The configs of the layouts the correctness check runs (those validate_args takes)."""
    out = []
    for layout in filter(lambda layout: selected(layout, args), layouts_for(world)):
        with contextlib.suppress(ConfigError):
            out.append(validate_args(parse_args(model + batch_flags(max(4, 2 * world))
                                                + list(layout.flags)), world))
    return out


def check_correctness(model: list[str], args, rank: int, world: int,
                      device: torch.device) -> Section:
    section = Section("Correctness: every layout against one process")
    batch = batch_flags(max(4, 2 * world))
    layouts = [layout for layout in layouts_for(world) if selected(layout, args)]
    precisions = {"fp32": ([], FP32)}
    if args.bf16_check == "on" or (args.bf16_check == "auto" and device.type != "cpu"):
        precisions["bf16"] = (["--bf16"], BF16)
    rows = []
    for precision, (flags, tolerance) in precisions.items():
        # Rank 0 runs the model alone; every rank receives its record.
        reference = [run_layout(model + batch + flags, 1, rank, device, args.steps)]
        dist.broadcast_object_list(reference, src=0)
        for layout in layouts:
            print0(f"  {precision} {layout.name}")
            try:
                run = run_layout(model + batch + flags + list(layout.flags), world, rank,
                                 device, args.steps)
            except ConfigError as e:  # refused alike on every rank, before any collective
                rows.append([layout.name, precision, "skipped", str(e)])
                continue
            problem = first_difference(run, reference[0], tolerance)
            problems = [(r, p) for r, p in enumerate(gathered(problem)) if p]
            if problems:
                section.failed = True
                r, p = problems[0]
                rows.append([layout.name, precision, "**FAIL**", f"rank {r}: {p}"])
                print0(f"FAIL {layout.name} ({precision}), rank {r}: {p}")
            else:
                rows.append([layout.name, precision, "ok", ""])
    section.lines += [
        f"{len(layouts)} layouts at world size {world}, each filling the launch with DP, "
        f"against one process on rank 0's {device.type} device: the initial values exactly, "
        f"then {args.steps} steps of loss and grad norm (fp32: {FP32.step_rtol:g} relative; "
        f"bf16: {BF16.step_rtol:g}) and the values after each update (fp32: rtol "
        f"{FP32.value_rtol:g}, atol {FP32.value_atol:g}). Layouts smaller than the launch "
        "run inside the product that fills it, not on a subset of the ranks.", ""]
    section.lines += table(["layout", "precision", "result", "first difference"], rows)
    return section


# ------------------------------------------------------------------ 2. collectives

def node_groups(world: int) -> tuple[object, list[list[int]], object]:
    """(this node's group, every node's ranks, a group of each node's first rank)."""
    hosts = gathered(socket.gethostname())
    nodes = [[r for r in range(world) if hosts[r] == h] for h in dict.fromkeys(hosts)]
    mine = None
    for ranks in nodes:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    leaders = dist.new_group([ranks[0] for ranks in nodes])
    return mine, nodes, leaders


def time_collective(fn, device, iters: int = 5) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    # The slowest rank sets the pace (on the device: NCCL reduces no host tensor).
    seconds = torch.tensor((time.perf_counter() - start) / iters, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def bus_bandwidths(group, ranks: list[int], size: int, device) -> dict[str, float]:
    """GB/s of nccl-tests' bus bandwidth for `size` bytes over `group` (None: not in it;
    every rank of the launch calls this for the same timings)."""
    n = len(ranks)
    numel = max(size // 4 // n, 1) * n
    x = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    me = dist.get_rank()
    inside = group is not None and me in ranks
    ops = {"all-reduce": lambda: dist.all_reduce(x, group=group),
           "all-gather": lambda: all_gather_into(x, part, group),
           "reduce-scatter": lambda: reduce_scatter_into(part, x, group)}
    out = {}
    for name, fn in ops.items():
        seconds = time_collective(fn if inside else (lambda: None), device)
        out[name] = numel * 4 / seconds * algorithm_factor(name, n) / 1e9
    # Paired p2p: rank i of the list with rank i + n/2, both directions at once.
    half = n // 2
    peer = None
    if inside and n >= 2 and ranks.index(me) < 2 * half:
        i = ranks.index(me)
        peer = ranks[i + half] if i < half else ranks[i - half]
    recv = torch.empty_like(x)

    def exchange():
        if peer is not None:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                                dist.P2POp(dist.irecv, recv, peer)]):
                work.wait()
    out["p2p"] = numel * 4 / time_collective(exchange, device) / 1e9
    return out


def layout_messages(configs) -> dict[int, set[str]]:
    """bytes -> what sends a message of about that size, over the layouts `configs`: sizes
    within 25% of the smallest of a run of them are measured once, at the largest."""
    sent = sorted((msg.size, msg.what) for config in configs for msg in step_traffic(config))
    sizes, first = {}, None
    for size, what in sent:
        if first is None or size > 1.25 * first:
            first, names = size, set()
        sizes.pop(next((s for s in sizes if sizes[s] is names), None), None)
        names.add(what)
        sizes[size] = names
    return sizes


def check_collectives(args, rank: int, world: int, device, configs, measured) -> Section:
    """Bus bandwidth at the sizes the layouts `configs` send (or --message-sizes), into
    `measured` {(op, bytes): GB/s over all ranks} for the tuner and the chart."""
    section = Section("Collectives: bus bandwidth (GB/s, nccl-tests' busbw)")
    if world == 1:
        section.lines.append("One rank: no collective to measure.")
        return section
    sizes = ({int(mib * 2 ** 20): {"--message-sizes"} for mib in args.message_sizes}
             if args.message_sizes else layout_messages(configs))
    node, nodes, leaders = node_groups(world)
    scopes = [("all ranks", dist.group.WORLD, list(range(world)))]
    if len(nodes) > 1:
        scopes += [("within a node", node, next(r for r in nodes if rank in r)),
                   ("across nodes (one rank a node)", leaders, [r[0] for r in nodes])]
    rows = []
    for scope, group, ranks in scopes:
        for size in sorted(sizes):
            bandwidth = bus_bandwidths(group, ranks, size, device)
            if scope == "all ranks":
                measured.update({(op, size): bw for op, bw in bandwidth.items()})
            rows.append([scope, f"{size / 2 ** 10:g}", ", ".join(sorted(sizes[size]))]
                        + [f"{bw:.3g}" for bw in bandwidth.values()])
    section.lines += [f"{len(nodes)} node(s), {world} ranks; the slowest rank's time of 5 "
                      "calls after one warm-up. The sizes are those the checked and tuned "
                      "layouts send (megalite/layout_tune.step_traffic: a DP bucket, a TP "
                      "activation, a PP activation, an FSDP2 unit, a CP K/V chunk) unless "
                      "--message-sizes is given.", ""]
    section.lines += table(["ranks", "KiB", "sent by", "all-reduce", "all-gather",
                            "reduce-scatter", "p2p (each direction)"], rows)
    return section


# ------------------------------------------------------------------ 3. scaling, 5. tuning

# Test-only: "<rank>:<layout name>" makes that rank's trial of that layout (the tuner's
# name for it) run out of memory in its first step.
TEST_HOOK = "MEGALITE_CHECK_CLUSTER_TEST_OOM"


def time_steps(flags: list[str], world: int, rank: int, device, steps: int,
               name: str = "") -> tuple[Trial, object]:
    """(the trial of `flags` on the first `world` ranks: the slowest rank's median seconds
    per step after one warm-up step and the most any rank's memory grew, or the rank that
    ran out of memory, which ends the trial and not the check (megalite/layout_trial.py);
    the config)."""
    inject = os.environ.get(TEST_HOOK) == f"{rank}:{name}"
    trial = time_layout(flags, world, rank, device, steps, inject_out_of_memory=inject)
    return trial, validate_args(parse_args(flags), world)


def world_sizes(world: int) -> list[int]:
    sizes, n = [], 1
    while n < world:
        sizes.append(n)
        n *= 2
    return sizes + [world]


def check_scaling(model: list[str], args, rank: int, world: int, device, charts) -> Section:
    section = Section("Weak scaling: tokens/s per rank against one rank")
    per_rank = 4
    rows, points = [], []
    base = None
    for n in world_sizes(world):
        trial, config = time_steps(model + batch_flags(per_rank * n), n, rank, device,
                                   args.timed_steps)
        if trial.out_of_memory:
            raise MegaliteError(f"weak scaling on {n} ranks ran out of memory on rank "
                                f"{trial.out_of_memory[0]}: {trial.out_of_memory[1]}")
        seconds = trial.seconds
        tokens = per_rank * n * config.model.seq_length / seconds / n
        base = base or tokens
        points.append((n, tokens / base))
        rows.append([n, f"{seconds * 1e3:.1f}", f"{tokens:.1f}", f"{100 * tokens / base:.1f}%"])
    section.lines += [f"DP on the first n ranks, {per_rank} sequences per rank per step, "
                      f"median of {args.timed_steps} steps after one warm-up; targets: > 90% "
                      "up to 8 ranks, > 80% at 32.", ""]
    section.lines += table(["ranks", "ms/step", "tokens/s per rank", "efficiency"], rows)
    below = [n for n, eff in points if eff < (0.9 if n <= 8 else 0.8)]
    if below:
        section.lines += ["", f"Below target at {below} ranks (reported, not a failure; on a "
                          "shared CPU the ranks split the same cores)."]
    charts["scaling.png"] = points
    return section


def planner(device) -> str:
    """The memory planner's device: "cuda" (its allocator's rounding) or "cpu"."""
    return device.type if device.type == "cuda" else "cpu"  # gpu_check: check_cluster_tune


def device_capacity(device, world: int, fraction: float) -> int:
    """Bytes a rank may plan for: `fraction` of the GPU's memory, or of the host's split
    over its ranks."""
    if device.type == "cuda":  # gpu_check: check_cluster_tune
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                 // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return int(fraction * total)


def tune_candidates(model: list[str], args, world: int, device) -> tuple[list[Candidate],
                                                                         list[str]]:
    """The layouts worth estimating and how many each step left; enumerated on rank 0 (a
    few hundred configs planned) and sent to the others."""
    result = [None]
    if dist.get_rank() == 0:
        capacity = device_capacity(device, world, args.memory_fraction)
        lean, valid = candidates(model, world, tune_global_batch(world),
                                 lambda config: planned_bytes(config, planner(device))
                                 <= capacity,
                                 args.tune_micro_batch_sizes)
        result[0] = lean, [
            f"{valid} layouts validate_args accepts (TP with SP, PP with 1 or 2 virtual "
            "stages, CP, DP; plain DP, ZeRO-1 or FSDP2 in either strategy; micro-batch "
            f"{' / '.join(map(str, args.tune_micro_batch_sizes))}); {len(lean)} fit "
            f"{capacity / GiB:.1f} GiB a rank by the memory planner (--memory-fraction "
            f"{args.memory_fraction:g} of the rank's memory), each with the least recompute "
            "(none, selective, full) that fits: recompute only buys memory with compute"]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def tune_global_batch(world: int) -> int:
    return max(8, 2 * world)


def time_candidate(candidate: Candidate, model: list[str], args, rank: int, world: int, device,
                   timed: dict, short: dict, what: str = "") -> bool:
    """Time `candidate` into `timed` {name: (seconds, memory, config)}; or, when a rank ran
    out of memory, say which in `short` {name: words for the report}. True if timed."""
    print0(f"  tune {candidate.name}{what}")
    trial, config = time_steps(model + list(candidate.flags), world, rank, device,
                               args.timed_steps, candidate.name)
    if trial.out_of_memory:
        r, message = trial.out_of_memory
        short[candidate.name] = f"out of memory on rank {r}"
        print0(f"  tune {candidate.name}: out of memory on rank {r}: {message}")
        return False
    timed[candidate.name] = (trial.seconds, trial.peak_bytes, config)
    return True


def check_tuning(model: list[str], args, rank: int, world: int, device, measured,
                 lean: list[Candidate], notes: list[str]) -> Section:
    section = Section("Layout tuning: the layouts the planner says fit, pruned, timed")
    if not lean:
        section.lines.append("No layout fits the device memory by the planner.")
        return section
    if not measured:  # --checks without collectives: measure what the candidates send
        check_collectives(args, rank, world, device, [c.config for c in lean], measured)
    timed, short = {}, {}
    # The default: plain DP at micro-batch 1; if it does not fit by the planner or runs out
    # of memory, the first layout that fits and runs.
    plain, default = tuple(batch_flags(tune_global_batch(world))), None
    for candidate in sorted(lean, key=lambda c: c.flags != plain):
        if time_candidate(candidate, model, args, rank, world, device, timed, short,
                          " (default)"):
            default = candidate
            break
    if default is None:
        section.lines += [f"Every layout the planner says fits ran out of memory "
                          f"({', '.join(f'{n}: {why}' for n, why in short.items())}); "
                          "a smaller --memory-fraction plans with more room."]
        return section
    flops = num_floating_point_operations(default.config.model,
                                          default.config.training.global_batch_size) / world
    rate = flops / timed[default.name][0]
    busbw = nearest_bandwidth(measured) if measured else (lambda op, size: math.inf)
    estimates = [Estimate(c, compute_seconds(c.config, world, rate),
                          communication_seconds(c.config, busbw)) for c in lean]
    kept, dropped = prune_by_bandwidth(estimates)
    for estimate in kept[:args.tune_max]:
        if estimate.candidate.name not in timed and estimate.candidate.name not in short:
            time_candidate(estimate.candidate, model, args, rank, world, device, timed, short)
    # The default again, last: of its two timings the faster counts, so a machine that got
    # busier during the tuning does not make the others look faster than it.
    again = {}
    time_candidate(default, model, args, rank, world, device, again, {}, " (default, again)")
    timed[default.name] = min(timed[default.name], again.get(default.name, timed[default.name]),
                              key=lambda result: result[0])
    by_name = {e.candidate.name: e for e in estimates}
    rows = sorted(((name, *result) for name, result in timed.items()), key=lambda r: r[1])
    section.lines += tuning_summary(notes, len(dropped), len(kept), world, args) + [""]
    section.lines += tuning_table(rows, short, by_name, default, world, device)
    section.lines += verdict(rows, by_name, default, model, world, short)
    return section


def tuning_summary(notes, dropped: int, kept: int, world: int, args) -> list[str]:
    timed = min(kept, args.tune_max)
    return [f"Global batch {tune_global_batch(world)}; " + "; ".join(notes)
            + f"; {dropped} dropped because their communication alone (the messages of "
            "megalite/layout_tune.step_traffic at the bus bandwidth measured above, no "
            "overlap) takes longer than the best layout's estimated whole step (compute at "
            "the FLOP rate the default layout measured, with the pipeline bubble and "
            f"recompute, plus its communication): such a layout cannot win; of the {kept} "
            f"left, the {timed} with the shortest estimated step (--tune-max {args.tune_max}) "
            f"and the default are timed, the median of {args.timed_steps} steps after one "
            "warm-up (the default first and again last, the faster kept), each in processes "
            "of its own: a rank that runs out of memory ends that layout's trial on every "
            "rank, the table says so, and the tuning goes on. MFU needs the device's peak "
            "FLOP rate (n/a on CPUs; --peak-tflops gives one). Measured memory is the most "
            "any rank's grew while the layout was built and run: max_memory_allocated on "
            "GPUs; on CPUs the resident set."]


def tuning_table(rows, short, by_name, default, world: int, device) -> list[str]:
    default_seconds = next(r[1] for r in rows if r[0] == default.name)
    peak = peak_tflops(device, compute_dtype(default.config.precision.params_dtype),
                       default.config.monitoring.peak_tflops)
    # gpu_check: check_cluster_tune
    what = "max_memory_allocated" if device.type == "cuda" else "peak RSS growth"
    out = []
    for name, seconds, memory, config in rows:
        batch = config.training.global_batch_size
        tokens = batch * config.model.seq_length / seconds
        flops = num_floating_point_operations(config.model, batch) / seconds / world
        mfu = f"{100 * flops / 1e12 / peak:.1f}" if peak else "n/a"
        planned = most_loaded_rank(config, planner(device))
        out.append([name + (" (default)" if name == default.name else ""), f"{tokens:.1f}",
                    f"{default_seconds / seconds:.2f}x", mfu,
                    f"{by_name[name].step * 1e3:.1f}", f"{seconds * 1e3:.1f}",
                    f"{planned.total / 2 ** 20:.1f}", f"{memory / 2 ** 20:.1f}"])
    for name, why in short.items():
        planned = most_loaded_rank(by_name[name].candidate.config, planner(device))
        out.append([name, why, "", "", f"{by_name[name].step * 1e3:.1f}", "",
                    f"{planned.total / 2 ** 20:.1f}", ""])
    return table(["layout", "tokens/s", "vs default", "MFU %", "estimated ms/step",
                  "measured ms/step", "planned MiB", f"measured MiB ({what})"], out)


def verdict(rows, by_name, default, model, world: int, short) -> list[str]:
    winner = rows[0]
    default_seconds = next(r[1] for r in rows if r[0] == default.name)
    flags = " ".join(model + list(by_name[winner[0]].candidate.flags))
    command = ["", "```bash", f"torchrun --nproc-per-node {world} pretrain_gpt.py {flags}",
               "```"]
    if winner[0] != default.name:
        return ["", f"Winner: {winner[0]}, {default_seconds / winner[1]:.2f}x the default "
                "layout's tokens/s, measured in the same run:"] + command
    estimated_best = min(by_name.values(), key=lambda e: e.step).candidate.name
    why = ("the estimate also ranks it first: it sends the least (one all-reduce of the "
           "gradients a step) and splits no matrix multiply, and the model is too small for "
           "a split to pay" if estimated_best == default.name else
           f"the estimate ranked {estimated_best} first, but measured it is slower: the "
           "estimate's FLOP rate comes from the default layout, and smaller matrix "
           "multiplies (TP, CP) or more micro-batches run at a lower rate than it")
    if default.flags != tuple(batch_flags(tune_global_batch(world))):
        plain = tuple(batch_flags(tune_global_batch(world)))
        ran_out = any(e.candidate.flags == plain and name in short
                      for name, e in by_name.items())
        why = ("plain DP at micro-batch 1 ran out of memory" if ran_out else
               "plain DP at micro-batch 1 does not fit by the planner") + \
            ", so the default here is the first layout that fits and runs"
    return ["", f"No layout is faster than the default ({default.name}); {why}. The default "
            "stays the command to run:"] + command
# ------------------------------------------------------------------ 4. checkpoints

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
    section = Section("Checkpoints: save and load throughput")
    directory = os.path.join(args.checkpoint_dir or args.output_dir, "check-cluster-ckpt")
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    flags = model + batch_flags(max(4, 2 * world)) + ["--use-distributed-optimizer"]
    config, state, chunks, optimizer, runner, batches = build_run(flags, world, rank, device)
    runner.train_step([next(batches) for _ in range(config.training.num_microbatches)])
    scheduler = LRScheduler(optimizer, config.scheduler)
    ckpt = CheckpointState(chunks, optimizer, scheduler, state, config,
                           TrainState(1, config.training.global_batch_size))
    timings = {}
    for what in ("save", "load"):
        dist.barrier()
        start = time.perf_counter()
        if what == "save":
            published = save_checkpoint(directory, 1, ckpt)
        else:
            load_checkpoint(directory, ckpt)
        sync(device)
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



# ------------------------------------------------------------------ 4b. recovery

# What a worker inherits from the check's own launcher and must not pass to the child's.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                "MASTER_PORT")


class Child:
    """A torchrun of pretrain_gpt.py whose output lines are kept with their arrival time."""

    def __init__(self, command: list[str], env: dict):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0):
        """(arrival time, match) of the first line after `after` matching `pattern`."""
        for when, line in list(self.lines):
            match = re.search(pattern, line)
            if when >= after and match:
                return when, match
        return None

    def wait_for(self, condition, deadline: float):
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = condition()
            if found:
                return found
            time.sleep(0.05)
        return condition()

    def stop(self):
        """SIGTERM the agent (it stops its workers); SIGKILL all after 30 s."""
        if self.proc.poll() is None:
            workers = torchrun_workers(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *workers.values()]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(10)

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def recovery_command(model: list[str], nproc: int, directory: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", "1", os.path.join(ROOT, "pretrain_gpt.py"), *model,
            *batch_flags(2 * nproc), "--save", directory, "--load", directory,
            "--save-interval", "3", "--log-interval", "1", "--eval-iters", "0"]


def time_recovery(model: list[str], nproc: int, directory: str, limit: float) -> dict:
    """Train under torchrun --max-restarts 1, SIGKILL the last worker once a checkpoint is
    published, and time from the kill to the end of the first resumed iteration (the
    line training's monitor prints then). {"problem": text} when that does not happen."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    child = Child(recovery_command(model, nproc, directory), env)
    try:
        tracker = os.path.join(directory, TRACKER_FILENAME)
        if not child.wait_for(lambda: os.path.exists(tracker), time.monotonic() + limit):
            return {"problem": "no checkpoint was published before the limit:\n" + child.tail()}
        killed = max(torchrun_workers(child.proc.pid).items())
        start = time.monotonic()
        os.kill(killed[1], signal.SIGKILL)
        resumed = child.wait_for(lambda: child.first(r"recovery time: ([\d.]+) s from process "
                                                     r"start .*\((\d+)\)", start),
                                 start + limit)
        if not resumed:
            return {"problem": f"no resumed iteration within {limit:.0f} s of the kill:\n"
                    + child.tail()}
        loaded = child.first(r"resuming from \S+ at iteration (\d+)", start)
        return {"seconds": resumed[0] - start, "worker_seconds": float(resumed[1][1]),
                "iteration": int(resumed[1][2]), "loaded": int(loaded[1][1]) if loaded else None,
                "killed": killed[0]}
    finally:
        child.stop()


def check_recovery(model: list[str], args, rank: int, world: int) -> Section:
    section = Section("Recovery: one rank killed, the job restarted from its checkpoint")
    nproc = args.recovery_nproc or min(2, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    directory = os.path.join(os.path.abspath(args.checkpoint_dir or args.output_dir),
                             "check-cluster-recovery")
    result = [None]
    if rank == 0:  # the other ranks wait (idle) in the broadcast
        shutil.rmtree(directory, ignore_errors=True)
        result[0] = time_recovery(model, nproc, directory, args.recovery_limit)
        shutil.rmtree(directory, ignore_errors=True)
    dist.broadcast_object_list(result, src=0)
    r = result[0]
    section.lines += [f"Rank 0 launched `torchrun --standalone --nproc-per-node {nproc} "
                      "--max-restarts 1 pretrain_gpt.py` (the check's model, a checkpoint "
                      "every 3 iterations), SIGKILLed one worker once a checkpoint was "
                      "published, and timed from the kill to the end of the first iteration "
                      "after the restart (torchrun noticing the death, stopping the others, "
                      "restarting every worker, the rendezvous, loading the checkpoint, one "
                      "step). A single-node restart: a lost node is the job scheduler's "
                      "requeue or torchrun's elastic rendezvous (README, \"Checkpoints: "
                      "save, resume, reshard, export\").",
                      ""]
    if "problem" in r:
        section.failed = True
        section.lines += ["**FAIL**: " + r["problem"].replace("\n", "  \n")]
        return section
    verdict = "meets" if r["seconds"] < TARGETS["recovery (s)"] else "misses"
    section.lines += table(["killed local rank", "resumed from iteration", "first resumed "
                            "iteration", "kill -> first resumed step (s)", "of which the "
                            "restarted worker's own (s)"],
                           [[r["killed"], r["loaded"], r["iteration"], f"{r['seconds']:.1f}",
                             f"{r['worker_seconds']:.1f}"]])
    section.lines += ["", f"{r['seconds']:.1f} s {verdict} the 5-minute recovery target."]
    if r["loaded"] is None or r["iteration"] != r["loaded"] + 1:
        section.failed = True
        section.lines += ["", f"**FAIL**: the first iteration after the restart is "
                          f"{r['iteration']}, not the one after the checkpoint loaded "
                          f"({r['loaded']})."]
    return section

# ------------------------------------------------------------------ the report

def import_pyplot():
    """matplotlib.pyplot on the Agg backend, or None when the `plot` extra is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def scaling_chart(plt, points, path: str):
    n, eff = zip(*points)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(n, [100 * e for e in eff], "o-", label="measured")
    for level in (90, 80):
        ax.axhline(level, linestyle="--", color="grey")
        ax.text(n[-1], level, f" {level}%", va="center")
    ax.set(xscale="log", xlabel="ranks", ylabel="efficiency (%)",
           ylim=(0, max(110, 110 * max(eff))), title="Weak scaling: tokens/s per rank vs 1 rank")
    ax.set_xticks(n, [str(v) for v in n])
    ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bandwidth_chart(plt, measured: dict, path: str):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for op in dict.fromkeys(op for op, _ in measured):
        sizes = sorted(size for o, size in measured if o == op)
        ax.plot([s / 2 ** 10 for s in sizes], [measured[op, s] for s in sizes], "o-", label=op)
    ax.set(xscale="log", yscale="log", xlabel="message (KiB)", ylabel="bus bandwidth (GB/s)",
           title="Collectives over all ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_charts(output_dir: str, charts: dict) -> list[str]:
    """The PNGs of `charts` ("scaling.png": points, "busbw.png": measured) and the report's
    lines linking them, or a line saying why there are none."""
    if not charts:
        return []
    plt = import_pyplot()
    if plt is None:
        return ["(Charts skipped: matplotlib is not installed; `pip install -e .[plot]` "
                "installs it.)", ""]
    draw = {"scaling.png": (scaling_chart, "weak scaling"),
            "busbw.png": (bandwidth_chart, "collective bus bandwidth")}
    lines = []
    for name, data in charts.items():
        fn, title = draw[name]
        fn(plt, data, os.path.join(output_dir, name + ".tmp.png"))
        os.replace(os.path.join(output_dir, name + ".tmp.png"), os.path.join(output_dir, name))
        lines += [f"![{title}]({name})", ""]
    return lines


def write_report(output_dir: str, sections: list[Section], charts: dict, header: list[str]):
    os.makedirs(output_dir, exist_ok=True)
    lines = ["# megalite cluster check", ""] + header + [""] + write_charts(output_dir, charts)
    for section in sections:
        took = f" ({section.seconds:.0f} s)" if section.seconds is not None else ""
        lines += [f"## {section.title}{' — FAILED' if section.failed else ''}{took}", ""]
        lines += section.lines + [""]
    path = os.path.join(output_dir, "REPORT.md")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)


def run_checks(model: list[str], args, rank: int, world: int, device) -> tuple[list, dict]:
    sections, charts, measured = [], {}, {}
    # Enumerated first: the collectives check measures what these layouts send too.
    lean, notes = tune_candidates(model, args, world, device) if args.tune else ([], [])
    checked = checked_configs(model, args, world)
    checks = {"correctness": lambda: check_correctness(model, args, rank, world, device),
              "collectives": lambda: check_collectives(args, rank, world, device,
                                                       checked + [c.config for c in lean],
                                                       measured),
              "scaling": lambda: check_scaling(model, args, rank, world, device, charts),
              "checkpoint": lambda: check_checkpoint(model, args, rank, world, device),
              "recovery": lambda: check_recovery(model, args, rank, world)}
    if args.tune:
        checks["tune"] = lambda: check_tuning(model, args, rank, world, device, measured, lean,
                                              notes)
    for name in args.checks + (["tune"] if args.tune else []):
        print0(f"check_cluster: {name}")
        start = time.perf_counter()
        sections.append(checks[name]())
        sections[-1].seconds = time.perf_counter() - start
        if measured and name == "collectives":
            charts["busbw.png"] = measured
    return sections, charts


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
    failed = [s.title for s in sections if s.failed]
    if rank == 0:
        header = [f"{world} ranks, backend {dist.get_backend()}, device {device.type}, "
                  f"torch {torch.__version__}; {time.time() - started:.0f} s.",
                  f"Result: {'FAILED: ' + '; '.join(failed) if failed else 'every check passed'}."]
        write_report(args.output_dir, sections, charts, header)
        for section in sections:
            print("\n".join([f"## {section.title}", *section.lines, ""]), flush=True)
        print(f"report: {os.path.join(args.output_dir, 'REPORT.md')}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


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
