"""Prove megalite on this cluster (issue 25; docs/design.md §18): every layout against one
process over the real backend, collective bandwidth, weak scaling, checkpoint throughput,
and (--tune) the fastest layout for a model. Run it the way training runs:

    torchrun --nproc-per-node 8 tools/check_cluster.py --output-dir cluster-report
    srun --ntasks-per-node 8 ... torchrun ... tools/check_cluster.py --output-dir ... --tune

On GPUs it uses NCCL, on CPUs gloo (--distributed-backend as in pretrain_gpt.py). Rank 0
writes REPORT.md (and PNG charts when matplotlib, the `plot` extra, is installed) to
--output-dir. Exit status 1 when a layout differs from one process; the measurements are
reported against the exercise's targets but never fail the check. docs/troubleshooting.md
says what each failure means.

1. Correctness: each layout of megalite/layout_check.layouts_for(world size), filling the
   launch with DP (a layout smaller than the launch is checked inside the product that
   fills it, not on a subset), against one process of the same model on rank 0's device:
   the initial values exactly, then per step the loss and grad norm (and the values after
   the update) in fp32 to the contract's tolerance; on GPUs also in bf16, to a stated bound.
2. Collectives: bus bandwidth of all-reduce, all-gather, reduce-scatter and paired p2p at
   --message-sizes, within a node and, with several nodes, across them (nccl-tests'
   busbw: all-reduce x 2(n-1)/n, all-gather and reduce-scatter x (n-1)/n, p2p x 1).
3. Scaling: weak scaling of the DP layout on the first 1, 2, 4, ... ranks and all of them.
4. Checkpoints: save and load throughput of megalite's checkpoints, and the projected save
   time of --project-model-size at this world size (the planner's parameter count).
5. --tune: the layouts the memory planner says fit, timed, by tokens/s.

Every flag it does not know is pretrain_gpt.py's and changes the model it checks (the
default is a 4-layer hidden-64 GPT small enough for a CPU).
"""

import argparse
import glob
import os
import shutil
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.config import DistributedConfig
from megalite.errors import ConfigError, MegaliteError
from megalite.initialize import initialize_distributed
from megalite.layout_check import (BF16, FP32, build_run, first_difference, layouts_for,
                                   run_layout)
from megalite.memory_estimate import GiB, most_loaded_rank, num_model_parameters
from megalite.monitoring.peak_flops import compute_dtype, peak_tflops
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.parallel_state import all_gather_into, reduce_scatter_into
from megalite.training import TrainState
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
TARGETS = {"scaling to 8": 0.9, "scaling at 32": 0.8, "13B save (s)": 120.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="Every other flag is pretrain_gpt.py's.")
    parser.add_argument("--output-dir", required=True, help="Where REPORT.md goes.")
    parser.add_argument("--checks", nargs="+", default=["correctness", "collectives",
                                                        "scaling", "checkpoint"],
                        choices=["correctness", "collectives", "scaling", "checkpoint"])
    parser.add_argument("--layouts", nargs="+", default=None, metavar="TEXT",
                        help="Check only the layouts whose name contains one of these.")
    parser.add_argument("--steps", type=int, default=3, help="Steps per layout (default 3).")
    parser.add_argument("--bf16-check", choices=["auto", "on", "off"], default="auto",
                        help="Also check every layout in bf16 (auto: on GPUs).")
    parser.add_argument("--message-sizes", nargs="+", type=float, default=None,
                        metavar="MIB", help="Collective sizes in MiB (default 1 16 128 on "
                        "GPUs, 0.0625 1 4 on CPUs).")
    parser.add_argument("--timed-steps", type=int, default=5,
                        help="Steps timed per world size and per tuned layout (default 5).")
    parser.add_argument("--project-model-size", default="13B",
                        help="Model whose save time to project (examples/configs/*_<size>*).")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="Where to write the test checkpoint (default: --output-dir).")
    parser.add_argument("--tune", action="store_true",
                        help="Time every layout the memory planner says fits.")
    return parser


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    failed: bool = False


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

def check_correctness(model: list[str], args, rank: int, world: int,
                      device: torch.device) -> Section:
    section = Section("Correctness: every layout against one process")
    batch = batch_flags(max(4, 2 * world))
    layouts = [layout for layout in layouts_for(world)
               if not args.layouts or any(text in layout.name for text in args.layouts)]
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
    numel = size // 4 // n * n
    x = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    me = dist.get_rank()
    inside = group is not None and me in ranks
    ops = {"all-reduce": (lambda: dist.all_reduce(x, group=group), 2 * (n - 1) / n),
           "all-gather": (lambda: all_gather_into(x, part, group), (n - 1) / n),
           "reduce-scatter": (lambda: reduce_scatter_into(part, x, group), (n - 1) / n)}
    out = {}
    for name, (fn, factor) in ops.items():
        seconds = time_collective(fn if inside else (lambda: None), device)
        out[name] = numel * 4 / seconds * factor / 1e9
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
    out["p2p (each direction)"] = numel * 4 / time_collective(exchange, device) / 1e9
    return out


def check_collectives(args, rank: int, world: int, device) -> Section:
    section = Section("Collectives: bus bandwidth (GB/s, nccl-tests' busbw)")
    sizes = args.message_sizes or ([1, 16, 128] if device.type != "cpu" else [1 / 16, 1, 4])
    node, nodes, leaders = node_groups(world)
    scopes = [("all ranks", dist.group.WORLD, list(range(world)))]
    if len(nodes) > 1:
        scopes += [("within a node", node, next(r for r in nodes if rank in r)),
                   ("across nodes (one rank a node)", leaders, [r[0] for r in nodes])]
    if world == 1:
        section.lines.append("One rank: no collective to measure.")
        return section
    rows = []
    for scope, group, ranks in scopes:
        for mib in sizes:
            bandwidth = bus_bandwidths(group, ranks, int(mib * 2 ** 20), device)
            rows.append([scope, f"{mib:g}"] + [f"{bw:.2f}" for bw in bandwidth.values()])
    section.lines += [f"{len(nodes)} node(s), {world} ranks; sizes in MiB; the slowest rank's "
                      "time of 5 calls after one warm-up.", ""]
    section.lines += table(["ranks", "MiB", "all-reduce", "all-gather", "reduce-scatter",
                            "p2p (each direction)"], rows)
    return section


# ------------------------------------------------------------------ 3. scaling, 5. tuning

def time_steps(flags: list[str], world: int, rank: int, device, steps: int):
    """Median seconds per step of `flags` on the first `world` ranks after one warm-up
    step (the slowest rank's; a median, as a shared machine makes single steps noisy),
    and the config."""
    config, _, model, optimizer, runner, batches = build_run(flags, world, rank, device)
    seconds = None
    if model is not None:
        n, times = config.training.num_microbatches, []
        for _ in range(steps + 1):
            start = time.perf_counter()
            runner.train_step([next(batches) for _ in range(n)])
            sync(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
    dist.barrier()
    return max(s for s in gathered(seconds) if s is not None), config


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
        seconds, config = time_steps(model + batch_flags(per_rank * n), n, rank, device,
                                     args.timed_steps)
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


def check_tuning(model: list[str], args, rank: int, world: int, device) -> Section:
    section = Section("Layout tuning: tokens/s of every layout the planner says fits")
    global_batch = max(8, 2 * world)
    capacity = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    default = ("DP, micro-batch 1 (default)", batch_flags(global_batch, 1))
    candidates = [default]
    for layout in layouts_for(world):
        if "FSDP2" in layout.name or any(k in layout.name for k in (" gpipe", " zb-h1",
                                                                    " all_gather")):
            continue  # the tuner tries ZeRO-1 and 1F1B / interleaved / p2p
        for micro in (1, 2, 4):
            if layout.flags or micro > 1:  # (DP alone at micro-batch 1 is the default)
                    candidates.append((f"{layout.name}, micro-batch {micro}",
                                   batch_flags(global_batch, micro) + list(layout.flags)))
    rows = []
    for name, flags in candidates:
        try:
            config = validate_args(parse_args(model + flags), world)
        except ConfigError:
            continue
        planned = most_loaded_rank(config, device.type if device.type == "cuda" else "cpu")
        if planned.total > capacity:
            continue
        print0(f"  tune {name}")
        seconds, _ = time_steps(model + flags, world, rank, device, args.timed_steps)
        tokens = global_batch * config.model.seq_length / seconds
        peak = peak_tflops(device, compute_dtype(config.precision.params_dtype))
        flops = num_floating_point_operations(config.model, global_batch) / seconds / world
        mfu = f"{100 * flops / 1e12 / peak:.1f}" if peak else "n/a"
        rows.append((tokens, name, flags, mfu, planned.total / GiB))
    rows.sort(key=lambda row: -row[0])
    default_tokens = next(row[0] for row in rows if row[1] == default[0])
    winner = rows[0]
    section.lines += [f"Global batch {global_batch}; {len(rows)} layouts fit (planned memory "
                      f"of the most loaded rank under {capacity / GiB:.1f} GiB), median of "
                      f"{args.timed_steps} steps after one warm-up.", ""]
    section.lines += table(["layout", "tokens/s", "vs default", "MFU %", "planned GiB"],
                           [[n, f"{t:.1f}", f"{t / default_tokens:.2f}x", m, f"{g:.3f}"]
                            for t, n, _, m, g in rows])
    section.lines += ["", f"Winner: {winner[1]}, {winner[0] / default_tokens:.2f}x the default "
                      "layout measured in the same run:", "", "```bash",
                      f"torchrun --nproc-per-node {world} pretrain_gpt.py "
                      + " ".join(model + winner[2]), "```"]
    return section


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
    timings = {}
    for what in ("save", "load"):
        dist.barrier()
        start = time.perf_counter()
        if what == "save":
            published = save_checkpoint(directory, 1, chunks, optimizer, scheduler, state,
                                        config, TrainState(1, config.training.global_batch_size))
        else:
            load_checkpoint(directory, chunks, optimizer, scheduler, state, config)
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
                      "which a small checkpoint understates on fast storage).",
                      "", "Not measured yet: a kill-and-restart of one rank timed from the kill "
                      "to the first resumed step (the 5-minute recovery target)."]
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return section


# ------------------------------------------------------------------ the report

def write_report(output_dir: str, sections: list[Section], charts: dict, header: list[str]):
    os.makedirs(output_dir, exist_ok=True)
    lines = ["# megalite cluster check", ""] + header + [""]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        lines += ["(No charts: matplotlib is not installed; `pip install -e .[plot]`.)", ""]
    if plt is not None and "scaling.png" in charts:
        n, eff = zip(*charts["scaling.png"])
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(n, [100 * e for e in eff], "o-", label="measured")
        for level in (90, 80):
            ax.axhline(level, linestyle="--", color="grey")
            ax.text(n[-1], level, f" {level}%", va="center")
        ax.set(xscale="log", xlabel="ranks", ylabel="efficiency (%)", ylim=(0, 110),
               title="Weak scaling: tokens/s per rank vs 1 rank")
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, "scaling.png"))
        lines += ["![weak scaling](scaling.png)", ""]
    for section in sections:
        lines += [f"## {section.title}{' — FAILED' if section.failed else ''}", ""]
        lines += section.lines + [""]
    with open(os.path.join(output_dir, "REPORT.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    args, model_flags = build_parser().parse_known_args(argv)
    model = MODEL + model_flags
    try:
        backend = parse_args(model).distributed_backend
        rank, world, device = initialize_distributed(DistributedConfig(backend=backend))
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The fp32 contract is fp32: no TF32 matmuls on the GPU.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    started = time.time()
    sections, charts = [], {}
    checks = {"correctness": lambda: check_correctness(model, args, rank, world, device),
              "collectives": lambda: check_collectives(args, rank, world, device),
              "scaling": lambda: check_scaling(model, args, rank, world, device, charts),
              "checkpoint": lambda: check_checkpoint(model, args, rank, world, device)}
    try:
        for name in args.checks:
            print0(f"check_cluster: {name}")
            sections.append(checks[name]())
        if args.tune:
            print0("check_cluster: tune")
            sections.append(check_tuning(model, args, rank, world, device))
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


if __name__ == "__main__":
    sys.exit(main())
