"""Pipeline bubble of megalite's schedules, simulated, next to the closed form
(Narayanan et al. 2021, §2.2; Qi et al. 2024, §3.1): (p-1)/m for 1F1B and GPipe,
(p-1)/(v*m) for interleaved 1F1B, (p-1)(F+B-W)/(m(F+B+W)) for ZB-H1 (m >= p, W <= F, B).

Every rank's action list from `build_schedule` runs on one clock in
megalite/pipeline_parallel/simulate.py: a model chunk's forward costs F, its input
gradient B and its weight gradient W (defaults 1, 1, 1: a whole backward B+W about twice
the forward), sends are free, and an action waits for the neighbouring stage's output.
Schedules that do not split the backward pay B+W for it. Bubble fraction = idle / busy per
rank = (makespan - m*v*(F+B+W)) / (m*v*(F+B+W)). The table also gives the peak number of
microbatch-chunks whose activations rank 0 holds at once (peak0: from F to the end of
the backward, to W when split) and that in units of one microbatch through all of rank
0's layers (act0 = peak0 / v, a chunk holding 1/v of them): interleaving buys its smaller
bubble with more activations in flight, GPipe holds all m, ZB-H1 as many as 1F1B.

    python benchmarks/pipeline_bubble.py [--pp 2 4 8 --chunks 1 2 4 --m-per-stage 1 2 4]

The measured step time of each schedule is benchmarks/pipeline_schedules_measured.py.
A simulated bubble that differs from its closed form exits non-zero (SMOKE=1 changes nothing:
the simulation already takes a fraction of a second).
"""

import argparse
from fractions import Fraction

from megalite.pipeline_parallel.schedules import SCHEDULES, build_schedule
from megalite.pipeline_parallel.simulate import simulate


def peak_in_flight(schedule) -> int:
    done = "weight" if any(a.kind == "weight" for a in schedule) else "backward"
    live = peak = 0
    for action in schedule:
        live += 1 if action.kind == "forward" else -1 if action.kind == done else 0
        peak = max(peak, live)
    return peak


def closed_form(schedule: str, p: int, m: int, v: int, F, B, W) -> Fraction:
    if schedule == "zb-h1":  # Qi et al. 2024 §3.1; m < p: only m-1 Ws fill the first wait
        return Fraction((p - 1) * (F + B) - (min(m, p) - 1) * W, m * (F + B + W))
    return Fraction(p - 1, v * m)


def check(name: str, p: int, m: int, v: int, measured: Fraction, formula: Fraction, F, B, W):
    """The closed form is exact; ZB-H1's holds only where W fits in F's and B's gaps."""
    if name == "zb-h1" and W > min(F, B):
        return
    if measured != formula:
        raise SystemExit(f"{name} p={p} m={m} v={v}: simulated bubble {measured} "
                         f"!= closed form {formula}")


def row(schedule: str, p: int, m: int, v: int, F, B, W) -> str:
    schedules = [build_schedule(p, r, m, v, schedule) for r in range(p)]
    sim = simulate(schedules, v, F, B, W)
    formula = closed_form(schedule, p, m, v, F, B, W)
    measured = sim.bubble_fraction
    peak = peak_in_flight(schedules[0])
    ratio = f"{float(measured / formula):5.3f}" if formula else "    -"
    name = "interleaved" if schedule == "1f1b" and v > 1 else schedule
    line = (f"{name:>11} {p:>2} {m:>3} {v:>2}  {sim.makespan:>8} {sim.busy:>6}  "
            f"{float(measured):>8.4f} {float(formula):>8.4f}  {ratio}  {peak:>5} {peak / v:>5.2f}")
    check(name, p, m, v, measured, formula, F, B, W)
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4],
                        help="model chunks (virtual stages) per rank, v")
    parser.add_argument("--m-per-stage", type=int, nargs="+", default=[1, 2, 4],
                        help="microbatches m as multiples of the pipeline size p")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--costs", type=int, nargs=3, default=[1, 1, 1],
                        metavar=("F", "B", "W"),
                        help="chunk forward, input-gradient and weight-gradient times")
    args = parser.parse_args()
    F, B, W = args.costs
    print(f"chunk forward F={F}, input gradient B={B}, weight gradient W={W} (unsplit "
          f"backward B+W={B + W}); busy = m*v*(F+B+W) per rank")
    print("   schedule  p   m  v  makespan   busy  measured  formula  ratio  peak0  act0")
    for schedule in args.schedules:
        for p in args.pp:
            for v in args.chunks:
                if (p == 1 or schedule != "1f1b") and v > 1:
                    continue  # nothing to interleave / GPipe and ZB-H1 run one chunk
                for k in args.m_per_stage:
                    print(row(schedule, p, k * p, v, F, B, W))


if __name__ == "__main__":
    main()
