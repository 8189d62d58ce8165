"""Weak scaling: plain DP on the first 1, 2, 4, ... ranks and all of them, a fixed number of
sequences per rank, tokens/s per rank against one rank."""

from megalite.arguments import parse_args
from megalite.cluster_check.report import Section, table
from megalite.cluster_check.shared import TARGETS, batch_flags, time_steps
from megalite.errors import MegaliteError


def world_sizes(world: int) -> list[int]:
    """1, 2, 4, ... below `world`, then `world`."""
    return [2 ** i for i in range((world - 1).bit_length())] + [world]


def check_scaling(model: list[str], args, rank: int, world: int, device, charts) -> Section:
    section = Section("Weak scaling: tokens/s per rank against one rank")
    per_rank = 4
    to_8, at_32 = TARGETS["scaling to 8"], TARGETS["scaling at 32"]
    rows, points = [], []
    base = None
    seq_length = parse_args(model).seq_length
    for n in world_sizes(world):
        trial = time_steps(model + batch_flags(per_rank * n), n, rank, device,
                           args.timed_steps)
        if trial.out_of_memory:
            raise MegaliteError(f"weak scaling on {n} ranks ran out of memory on rank "
                                f"{trial.out_of_memory[0]}: {trial.out_of_memory[1]}")
        seconds = trial.seconds
        tokens = per_rank * n * seq_length / seconds / n
        base = base or tokens
        points.append((n, tokens / base))
        rows.append([n, f"{seconds * 1e3:.1f}", f"{tokens:.1f}", f"{100 * tokens / base:.1f}%"])
    section.lines += [f"DP on the first n ranks, {per_rank} sequences per rank per step, "
                      f"median of {args.timed_steps} steps after one warm-up; targets: > "
                      f"{to_8:.0%} up to 8 ranks, > {at_32:.0%} at 32.", ""]
    section.lines += table(["ranks", "ms/step", "tokens/s per rank", "efficiency"], rows)
    below = [n for n, eff in points if eff < (to_8 if n <= 8 else at_32)]
    if below:
        section.lines += ["", f"Below target at {below} ranks (reported, not a failure; on a "
                          "shared CPU the ranks split the same cores)."]
    charts["scaling.png"] = points
    return section
