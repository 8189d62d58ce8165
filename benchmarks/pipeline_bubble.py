"""Pipeline bubble of megalite's schedules, simulated, next to the closed form
(Narayanan et al. 2021, §2.2): (p-1)/m for 1F1B, (p-1)/(v*m) for interleaved 1F1B.

Every rank's action list from `build_schedule` runs on one clock in
megalite/pipeline_parallel/simulate.py: a model chunk's forward costs F, its backward B
(defaults 1 and 2, backward being about twice the forward), sends are free, and an action
waits for the neighbouring stage's output. Bubble fraction = idle / busy per rank =
(makespan - m*v*(F+B)) / (m*v*(F+B)). The table also gives the peak number of
microbatch-chunks whose activations rank 0 holds at once (peak0, its warmup + 1) and that
in units of one microbatch through all of rank 0's layers (act0 = peak0 / v, a chunk
holding 1/v of them): interleaving buys its smaller bubble with more activations in flight.

    python benchmarks/pipeline_bubble.py [--pp 2 4 8 --chunks 1 2 4 --m-per-stage 1 2 4]
"""

import argparse

from megalite.pipeline_parallel.schedules import build_schedule
from megalite.pipeline_parallel.simulate import simulate


def peak_in_flight(schedule) -> int:
    live = peak = 0
    for action in schedule:
        live += 1 if action.kind == "forward" else -1
        peak = max(peak, live)
    return peak


def row(p: int, m: int, v: int, forward_cost: int, backward_cost: int) -> str:
    schedules = [build_schedule(p, r, m, v) for r in range(p)]
    sim = simulate(schedules, v, forward_cost, backward_cost)
    formula = (p - 1) / (v * m)
    measured = float(sim.bubble_fraction)
    peak = peak_in_flight(schedules[0])
    ratio = f"{measured / formula:5.3f}" if formula else "    -"
    return (f"{p:>2} {m:>3} {v:>2}  {sim.makespan:>8} {sim.busy:>6}  {measured:>8.4f} "
            f"{formula:>8.4f}  {ratio}  {peak:>5} {peak / v:>5.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4],
                        help="model chunks (virtual stages) per rank, v")
    parser.add_argument("--m-per-stage", type=int, nargs="+", default=[1, 2, 4],
                        help="microbatches m as multiples of the pipeline size p")
    parser.add_argument("--forward-cost", type=int, default=1)
    parser.add_argument("--backward-cost", type=int, default=2)
    args = parser.parse_args()
    print(f"chunk forward F={args.forward_cost}, chunk backward B={args.backward_cost}; "
          f"busy = m*v*(F+B) per rank")
    print(" p   m  v  makespan   busy  measured  formula  ratio  peak0  act0")
    for p in args.pp:
        for v in args.chunks:
            if p == 1 and v > 1:
                continue  # one stage has nothing to interleave
            for k in args.m_per_stage:
                print(row(p, k * p, v, args.forward_cost, args.backward_cost))


if __name__ == "__main__":
    main()
