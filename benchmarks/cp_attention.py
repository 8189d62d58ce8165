"""Bytes moved by context-parallel attention per transformer layer per step, counted at the
collectives, next to the closed form (megalite/context_parallel/attention.py).

One forward + backward of `context_parallel_attention` on one micro-batch [b, s, heads, d]
(each CP rank holding its two load-balanced chunks) runs on CP gloo processes for each
`--cp-comm-type`, with the torch.distributed calls it makes wrapped to record, per call, the
bytes this rank receives from the others: an all-gather's output minus this rank's input, a
reduce-scatter's input minus this rank's output, the irecv buffers of a batch_isend_irecv.

Closed form (B = b·(s/CP)·kv_heads·d·e, this rank's K or V shard):
- all_gather: forward 2(CP-1)B, backward 2(CP-1)B;
- p2p (ring): forward 2(CP-1)B, backward 2(CP-1)B (K/V again) + 2·CP·B (dK/dV accumulators,
  fp32: 2·CP·2B for bf16 K/V).
A step of m micro-batches moves m times this per layer (twice the forward's with full or
selective recompute, which reruns the attention forward).

    python benchmarks/cp_attention.py [--batch 1 --seq 2048 --heads 16 --kv-heads 16 4
                                       --head-dim 64 --cp 2 4]

A count that differs from the closed form stops the run non-zero. SMOKE=1: s=64, 4 heads,
d=8, the same CP degrees, comm types and kv-head ratio.
"""

import argparse
import functools
import sys
from collections import Counter
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.rank_setup import launch
from benchmarks.common.smoke import shrink
from megalite.context_parallel import COMM_TYPES, context_parallel_attention, cp_comm_bytes

ALL_GATHER = ("all_gather_single", "all_gather_into_tensor")          # new, old torch names
REDUCE_SCATTER = ("reduce_scatter_single", "reduce_scatter_tensor")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _received(name, args) -> int:
    if name in ALL_GATHER:            # (output, input)
        return _nbytes(args[0]) - _nbytes(args[1])
    if name in REDUCE_SCATTER:        # (output, input)
        return _nbytes(args[1]) - _nbytes(args[0])
    return sum(_nbytes(op.tensor) for op in args[0] if op.op is dist.irecv)


def _record(records: list, phase: list):
    """Wrap the calls context-parallel attention makes; record (phase, call, bytes received)."""
    def wrap(name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            records.append((phase[0], name, _received(name, args)))
            return original(*args, **kwargs)
        return counted
    for name in (*ALL_GATHER, *REDUCE_SCATTER, "batch_isend_irecv"):
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _worker(rank, cp, args):
    records, phase = [], ["forward"]
    _record(records, phase)
    s_local = args.seq // cp
    results = {}
    for kv_heads in args.kv_heads:
        for comm_type in COMM_TYPES:
            torch.manual_seed(rank)  # the values do not matter, only the shapes
            q = torch.randn(args.batch, s_local, args.heads, args.head_dim, requires_grad=True)
            k, v = (torch.randn(args.batch, s_local, kv_heads, args.head_dim, requires_grad=True)
                    for _ in range(2))
            records.clear()
            phase[0] = "forward"
            out = context_parallel_attention(q, k, v, cp_group=dist.group.WORLD,
                                             comm_type=comm_type, backend="unfused")
            phase[0] = "backward"
            out.backward(torch.randn_like(out))
            results[f"{kv_heads}/{comm_type}"] = list(records)
    return results


def report(cp, kv_heads, comm_type, records, args):
    measured = {p: sum(n for phase, _, n in records if phase == p) for p in ("forward", "backward")}
    closed = cp_comm_bytes(comm_type, cp_size=cp, batch=args.batch, seq_length=args.seq,
                           kv_heads=kv_heads, head_dim=args.head_dim, element_size=4)
    calls = Counter((phase, name) for phase, name, _ in records)  # forward first
    calls = sorted(calls.items(), key=lambda item: (item[0][0] != "forward", item[0][1]))
    total = measured["forward"] + measured["backward"]
    print(f"| {cp} | {args.heads}/{kv_heads} | {comm_type} | {measured['forward']:,d} | "
          f"{closed.forward:,d} | {measured['backward']:,d} | {closed.backward:,d} | "
          f"{total / closed.total:.3f} | "
          + ", ".join(f"{phase} {n} x {name}" for (phase, name), n in calls)
          + " |")
    for phase in ("forward", "backward"):
        if measured[phase] != getattr(closed, phase):
            raise SystemExit(f"CP {cp}, kv heads {kv_heads}, {comm_type}: {phase} moved "
                             f"{measured[phase]:,d} bytes, closed form {getattr(closed, phase):,d}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    args = shrink(parser.parse_args(), seq=64, heads=4, kv_heads=[4, 1], head_dim=8)
    print(f"per transformer layer, one micro-batch forward + backward, b={args.batch} "
          f"s={args.seq} heads={args.heads} d={args.head_dim}, fp32; bytes each CP rank "
          f"receives")
    print("| CP | heads/kv heads | --cp-comm-type | forward bytes | closed form | "
          "backward bytes | closed form | total / closed form | calls |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for cp in args.cp:
        per_rank = launch(cp, _worker, args)
        if any(r != per_rank[0] for r in per_rank):
            raise RuntimeError(f"CP ranks recorded different traffic at CP={cp}")
        for kv_heads in args.kv_heads:
            for comm_type in COMM_TYPES:
                report(cp, kv_heads, comm_type, per_rank[0][f"{kv_heads}/{comm_type}"], args)


if __name__ == "__main__":
    main()
