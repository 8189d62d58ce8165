"""--tune: the layouts the memory planner says fit (--memory-fraction of a rank's memory),
pruned by an estimate from the measured bandwidth (layout_tune.py), the best few timed
against the default, by tokens/s, each in processes of its own (layout_trial.py): a layout
that runs out of memory on a rank is reported as such and the tuning goes on."""

import math
import os

import torch
import torch.distributed as dist

from megalite.cluster_check.collectives import check_collectives
from megalite.cluster_check.report import Section, table
from megalite.cluster_check.shared import batch_flags, time_steps
from megalite.layout_tune import (Candidate, Estimate, candidates, communication_seconds,
                                  compute_seconds, nearest_bandwidth, planned_bytes,
                                  prune_by_bandwidth)
from megalite.memory_estimate import GiB, most_loaded_rank
from megalite.monitoring.peak_flops import compute_dtype, mfu_percent, peak_tflops
from megalite.parallel_state import print_rank_0
from megalite.training_log import num_floating_point_operations

TITLE = "Layout tuning: the layouts the planner says fit, pruned, timed"


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
        nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
        lean, valid = candidates(model, world, tune_global_batch(world),
                                 lambda config: planned_bytes(config, planner(device))
                                 <= capacity,
                                 args.tune_micro_batch_sizes, nodes=nodes)
        result[0] = lean, [
            f"{valid} layouts validate_args accepts (TP with SP, PP with 1 or 2 virtual "
            "stages, CP, DP; plain DP, ZeRO-1 or FSDP2 in either strategy"
            + (f", each sharded one also over N = the nodes replicas (HSDP, "
               f"--num-distributed-optimizer-instances {nodes})" if nodes > 1 else "")
            + "; micro-batch "
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
    print_rank_0(f"  tune {candidate.name}{what}")
    trial = time_steps(model + list(candidate.flags), world, rank, device, args.timed_steps,
                       candidate.name)
    if trial.out_of_memory:
        r, message = trial.out_of_memory
        short[candidate.name] = f"out of memory on rank {r}"
        print_rank_0(f"  tune {candidate.name}: out of memory on rank {r}: {message}")
        return False
    timed[candidate.name] = (trial.seconds, trial.peak_bytes, candidate.config)
    return True


def check_tuning(model: list[str], args, rank: int, world: int, device, measured,
                 lean: list[Candidate], notes: list[str]) -> Section:
    section = Section(TITLE)
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
        mfu = f"{mfu_percent(flops / 1e12, peak):.1f}" if peak else "n/a"
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
    plain = tuple(batch_flags(tune_global_batch(world)))
    if default.flags != plain:
        ran_out = any(e.candidate.flags == plain and name in short
                      for name, e in by_name.items())
        why = ("plain DP at micro-batch 1 ran out of memory" if ran_out else
               "plain DP at micro-batch 1 does not fit by the planner") + \
            ", so the default here is the first layout that fits and runs"
    return ["", f"No layout is faster than the default ({default.name}); {why}. The default "
            "stays the command to run:"] + command
