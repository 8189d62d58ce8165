"""Correctness: each layout of layout_check.layouts_for(world size), filling the launch with
DP (a layout smaller than the launch is checked inside the product that fills it, not on a
subset), against one process of the same model on rank 0's device: the initial values
exactly, then per step the loss and grad norm (and the values after the update) in fp32 to
the contract's tolerance; on GPUs also in bf16, to a stated bound."""

import contextlib
import fnmatch

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.cluster_check.report import Section, table
from megalite.cluster_check.shared import batch_flags, gathered
from megalite.errors import ConfigError
from megalite.layout_check import BF16, FP32, first_difference, layouts_for, run_layout
from megalite.parallel_state import print_rank_0
from megalite.validation import validate_args


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
            print_rank_0(f"  {precision} {layout.name}")
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
                print_rank_0(f"FAIL {layout.name} ({precision}), rank {r}: {p}")
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

