"""Draw a pipeline schedule's simulated timeline as a PNG: one row per pipeline rank, a box
per action labelled with its micro-batch, coloured by pass (F forward, B backward or input
gradient, W weight gradient) and shaded by model chunk, idle time blank (the figures of
the Megatron and Zero Bubble papers).

The timeline is megalite's own: every rank's action list from `build_schedule` run on one
clock by megalite/pipeline_parallel/simulate.py with chunk costs F, B, W (a schedule that
does not split the backward pays B+W for it).

    python tools/plot_schedule.py --schedule zb-h1 --pp 4 --microbatches 8 \\
        --costs 1 1 1 --output docs/schedule_zb_h1.png

matplotlib is an optional extra: pip install 'megalite[plot]'.
"""

import argparse
import sys
from dataclasses import dataclass

from megalite.atomic_write import atomic_path
from megalite.errors import ConfigError
from megalite.pipeline_parallel.schedules import SCHEDULES, WEIGHT, build_schedule
from megalite.pipeline_parallel.simulate import simulate, stage_work
from megalite.pipeline_parallel.stages import Stage

# Base colours per pass (F, B, W); chunk c is mixed towards white by c / (v + 1).
COLOURS = {"forward": (0.22, 0.42, 0.80), "backward": (0.20, 0.62, 0.30),
           "weight": (0.93, 0.55, 0.13)}


@dataclass(frozen=True)
class Box:
    rank: int
    start: float
    end: float
    kind: str
    microbatch: int
    chunk: int


def timeline(schedule: str, pp: int, microbatches: int, chunks: int = 1,
             costs: tuple = (1, 1, 1), work_per_stage=None) -> tuple[list[Box], object]:
    """Every action of every rank as a box on the simulator's clock, and the Simulation."""
    schedules = [build_schedule(pp, r, microbatches, chunks, schedule) for r in range(pp)]
    sim = simulate(schedules, chunks, *costs, work_per_stage=work_per_stage)
    boxes = []
    for rank, actions in enumerate(schedules):
        for a in actions:
            key = (a.kind, a.microbatch, Stage(a.chunk, rank, pp, chunks).index)
            boxes.append(Box(rank, sim.start[key], sim.finish[key], a.kind, a.microbatch,
                             a.chunk))
    return boxes, sim


def _colour(kind: str, chunk: int, chunks: int):
    mix = chunk / (chunks + 1)
    return tuple(c + (1 - c) * mix for c in COLOURS[kind])


def draw(boxes: list[Box], sim, title: str, chunks: int, output: str):
    """Write the figure to `output` (through a temporary name, renamed when complete)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise SystemExit("tools/plot_schedule.py needs matplotlib: pip install "
                         "'megalite[plot]' (or pip install matplotlib)") from e
    ranks = max(b.rank for b in boxes) + 1
    unit = min(b.end - b.start for b in boxes)  # the shortest box gets room for its label
    fig, ax = plt.subplots(figsize=(max(6.0, sim.makespan / unit * 0.22), 0.55 * ranks + 1.3))
    for b in boxes:
        ax.barh(b.rank, b.end - b.start, left=b.start, height=0.8,
                color=_colour(b.kind, b.chunk, chunks), edgecolor="black", linewidth=0.4)
        ax.text((b.start + b.end) / 2, b.rank, str(b.microbatch), ha="center",
                va="center", fontsize=7, color="white" if b.chunk == 0 else "black")
    split = any(b.kind == WEIGHT for b in boxes)
    names = {"forward": "F", "backward": "B (input grad)" if split else "B (whole backward)",
             "weight": "W (weight grad)"}
    kinds = [k for k in names if any(b.kind == k for b in boxes)]
    ax.legend(handles=[Patch(color=_colour(k, c, chunks),
                             label=names[k] + (f", chunk {c}" if chunks > 1 else ""))
                       for k in kinds for c in range(chunks)],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if ranks > 2 else -0.5),
              ncol=len(kinds) * chunks, fontsize=7, frameon=False)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time (simulated)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    with atomic_path(output, suffix=".partial.png") as partial:
        fig.savefig(partial, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="as --pipeline-schedule (1f1b is interleaved with --chunks > 1)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches m")
    parser.add_argument("--chunks", type=int, default=1,
                        help="model chunks (virtual stages) per rank v")
    parser.add_argument("--costs", type=float, nargs=3, default=[1, 1, 1],
                        metavar=("F", "B", "W"),
                        help="chunk forward, input-gradient and weight-gradient times")
    parser.add_argument("--stage-layers", type=int, nargs="+", metavar="L",
                        help="layers of each global stage (p*v values, chunk c of rank r is "
                             "stage c*p + r): uneven stages; costs are per layer")
    parser.add_argument("--embedding-layers", type=float, default=0,
                        help="with --stage-layers: the embedding's work in layers (first stage)")
    parser.add_argument("--loss-layers", type=float, default=0,
                        help="with --stage-layers: the output layer's and loss's work in "
                             "layers (last stage)")
    parser.add_argument("--output", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    costs = tuple(int(c) if c == int(c) else c for c in args.costs)
    work = None
    if args.stage_layers is not None:
        if len(args.stage_layers) != args.pp * args.chunks:
            print(f"error: --stage-layers has {len(args.stage_layers)} values, expected "
                  f"--pp x --chunks = {args.pp * args.chunks}", file=sys.stderr)
            return 1
        work = stage_work(args.stage_layers, args.embedding_layers, args.loss_layers)
    try:
        boxes, sim = timeline(args.schedule, args.pp, args.microbatches, args.chunks, costs,
                              work)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    name = "interleaved 1F1B" if args.schedule == "1f1b" and args.chunks > 1 else \
        {"1f1b": "1F1B", "gpipe": "GPipe", "zb-h1": "ZB-H1"}[args.schedule]
    title = (f"{name}: p={args.pp}, m={args.microbatches}, v={args.chunks}, "
             f"F:B:W = {':'.join(f'{c:g}' for c in costs)}; "
             f"bubble {float(sim.bubble_fraction):.3f}")
    if work is not None:
        title += (f"; stage layers {args.stage_layers}, step {float(sim.makespan):g}, "
                  f"idle {float(sim.idle_fraction):.3f}")
    draw(boxes, sim, title, args.chunks, args.output)
    print(f"wrote {args.output} ({title})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
