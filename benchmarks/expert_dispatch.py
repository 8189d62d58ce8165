"""The expert-parallel token exchange: bytes per step counted at the collectives next to
their closed form, and tokens/s of dispatch + experts + combine (forward and backward) for
the all-to-all and all-gather dispatchers, next to the same layer with all experts local on
one rank (EP 1), measured in the same run (megalite/expert_parallel/exchange.py).

Each EP rank routes T tokens of width h to k of E experts (uniform random, dropless); each
expert is a [h, h] linear map. Byte conventions ("tensor bytes", e = bytes of an element):
the all-to-all's input, the all-gather's output, the reduce-scatter's input. Closed form
per step and rank:
- alltoall: the T k rows this rank routes go out (dispatch) and the R rows its experts
  received go back (combine), and the same again in backward: 2 (T k + R) h e, plus the
  [E] int64 counts exchange: 8 E (R from every rank's routing, known to each).
- allgather: gathers hidden (EP T h e), probabilities (EP T k 4), choices (EP T k 8) and
  keep flags (EP T k 1); the combine reduce-scatters EP T h fp32 (4 bytes: the weighting is
  in fp32); backward reduce-scatters the hidden gradient (EP T h e) and the probabilities'
  (EP T k 4) and all-gathers the combine's (EP T h 4).
The all-to-all's bytes do not grow with EP; the all-gather's do, linearly.

    python benchmarks/expert_dispatch.py [--tokens 2048 --hidden 256 --experts 8 --topk 2 --ep 4 --steps 10]

Bytes off the closed form exit non-zero. SMOKE=1 (benchmarks/common/smoke.py): T=64, h=32, 3 steps.
"""

import argparse
import functools
import sys
import time
from collections import Counter
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.rank_setup import launch
from benchmarks.common.smoke import shrink
from megalite.expert_parallel.dispatch import TokenDispatcher

COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter_tensor", "reduce_scatter_single")


def received_rows(args, rank: int) -> int:
    """R: the (token, choice) pairs of every EP rank routed to `rank`'s experts."""
    local = args.experts // args.ep
    return sum(int(((routed(args, r)[2] // local) == rank).sum()) for r in range(args.ep))


def closed_form(kind: str, t: int, h: int, e: int, k: int, ep: int, element: int,
                received: int) -> int:
    if kind == "alltoall":
        return 2 * (t * k + received) * h * element + 8 * e
    gathered = ep * t * (h * element + k * (4 + 8 + 1))
    return gathered + ep * t * h * 4 + ep * t * (h * element + k * 4) + ep * t * h * 4


def routed(args, rank: int):
    g = torch.Generator().manual_seed(rank)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    indices = torch.stack([torch.randperm(args.experts, generator=g)[:args.topk]
                           for _ in range(args.tokens)])
    probs = torch.rand(args.tokens, args.topk, generator=g)
    return hidden, probs, indices, torch.ones_like(indices, dtype=torch.bool)


def one_step(dispatcher, experts, hidden, probs, indices, keep):
    hidden, probs = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    rows, counts = dispatcher.dispatch(hidden, probs, indices, keep)
    out = torch.cat([x @ w for x, w in zip(rows.split(counts.tolist()), experts)])
    dispatcher.combine(out).sum().backward()


def measure(rank, world, args, kind):
    """Per rank: (tensor bytes of one step, seconds per step)."""
    group = dist.group.WORLD if kind != "local" else None
    ep = world if group is not None else 1
    experts = (torch.randn(args.experts // ep, args.hidden, args.hidden)
               / args.hidden ** 0.5).requires_grad_()
    dispatcher = TokenDispatcher(args.experts, ep_group=group,
                                 kind="alltoall" if kind == "local" else kind)
    data = routed(args, rank)
    one_step(dispatcher, experts, *data)  # warm-up
    counted = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        @functools.wraps(fn)
        def wrapper(out, inp, *a, **kw):
            big = inp if name.startswith(("all_to_all", "reduce_scatter")) else out
            counted["bytes"] += big.numel() * big.element_size()
            return fn(out, inp, *a, **kw)
        return wrapper
    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        one_step(dispatcher, experts, *data)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    if group is not None:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        one_step(dispatcher, experts, *data)
    if group is not None:
        dist.barrier()
    return counted["bytes"], (time.perf_counter() - t0) / args.steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="T: tokens each rank routes")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = shrink(parser.parse_args(), tokens=64, hidden=32, steps=3)
    print(f"T={args.tokens} tokens per rank, h={args.hidden}, E={args.experts}, "
          f"top-{args.topk}, EP={args.ep}, fp32, gloo on the CPU, one thread per rank")
    local_bytes, local_s = launch(1, measure, args, "local")[0]
    print("| dispatcher | ranks | tensor bytes/step/rank | closed form | s/step | tokens/s/rank |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| local (EP 1, reference) | 1 | {local_bytes:,} | 0 | {local_s:.4f} | "
          f"{args.tokens / local_s:,.0f} |")
    failures = []
    for kind in ("alltoall", "allgather"):
        results = launch(args.ep, measure, args, kind)
        expected = [closed_form(kind, args.tokens, args.hidden, args.experts, args.topk,
                                args.ep, 4, received_rows(args, r)) for r in range(args.ep)]
        seconds = max(s for _, s in results)
        print(f"| {kind} | {args.ep} | {results[0][0]:,} | {expected[0]:,} | {seconds:.4f} | "
              f"{args.tokens / seconds:,.0f} |")
        failures += [f"{kind} rank {r}: {b} bytes, closed form {expected[r]}"
                     for r, (b, _) in enumerate(results) if b != expected[r]]
    if local_bytes:
        failures.append(f"the local path moved {local_bytes} bytes")
    if failures:
        raise SystemExit("bytes off the closed form:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
