"""Bytes moved by tensor-parallel collectives per transformer layer per step, counted at the
collectives, next to the closed form (Megatron-LM §3; Korthikanti et al. 2022, §4.2.2).

A layer is built from megalite's ColumnParallelLinear / RowParallelLinear as in the model:
attention QKV column + output projection row, MLP fc1 column + fc2 row (the attention core
and the activation are local to each rank and move nothing). One forward + backward of a
micro-batch [s, b, h] runs on TP gloo processes with `dist.all_reduce`,
`dist.all_gather_single` and `dist.reduce_scatter_single` (all_gather_into_tensor and
reduce_scatter_tensor before torch 2.13) wrapped to record each call.

Byte conventions (e = bytes per element, N = TP size):
- "tensor bytes": the size of the full tensor each collective is about: the all-reduced
  tensor, the all-gather's output, the reduce-scatter's input. Each is b*s*h*e here.
- "wire bytes": what each rank sends with the ring algorithm: all-reduce 2(N-1)/N x tensor
  bytes, all-gather and reduce-scatter (N-1)/N x tensor bytes.
Closed form per layer per step:
- without SP: 4 all-reduces of b*s*h (2 forward after the row layers, 2 backward before
  the column layers): tensor bytes 4 bshe, wire bytes 8(N-1)/N bshe.
- with SP: 4 all-gathers + 4 reduce-scatters of b*s*h: tensor bytes 8 bshe, wire bytes
  8(N-1)/N bshe, the same wire volume. ColumnParallelLinear keeps its gathered input for the
  weight gradient, so backward does no extra all-gather (Megatron re-gathers: +2 per layer).

    python benchmarks/tp_communication.py [--batch 2 --seq 64 --hidden 64 --heads 8 --tp 2 4]

Bytes off the closed form exit non-zero. SMOKE=1 (benchmarks/common/smoke.py): b=1, s=16, h=32.
"""

import argparse
import functools
import math
import sys
from collections import Counter
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common.rank_setup import launch
from benchmarks.common.smoke import shrink
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# torch >= 2.13 names the last two all_gather_single / reduce_scatter_single (the old names
# are deprecated aliases); the mappings call whichever exists, so both are wrapped.
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather_single", "reduce_scatter_single")
ALL_GATHER = ("all_gather_into_tensor", "all_gather_single")


class TensorParallelLayer(nn.Module):
    """The communication skeleton of a transformer layer (norms and dropout move nothing)."""

    def __init__(self, hidden: int, heads: int, group, sequence_parallel: bool):
        super().__init__()
        tp = dist.get_world_size(group)
        self.local_heads = heads // tp
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        self.linear_qkv = ColumnParallelLinear(hidden, 3 * hidden, **kw)
        self.linear_proj = RowParallelLinear(hidden, hidden, **kw)
        self.linear_fc1 = ColumnParallelLinear(hidden, 4 * hidden, **kw)
        self.linear_fc2 = RowParallelLinear(4 * hidden, hidden, **kw)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def attention(self, x):
        qkv = self.linear_qkv(x)                                  # [s, b, 3h / tp]
        s, b, _ = qkv.shape
        q, k, v = (t.reshape(s, b, self.local_heads, -1).permute(1, 2, 0, 3)
                   for t in qkv.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _record_collectives(records: list, phase: list):
    """Wrap the torch.distributed collectives the mappings call; record (phase, op, bytes)."""
    def wrap(name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if name == "all_reduce":
                tensor = args[0]                                   # all_reduce(tensor)
            elif name in ALL_GATHER:
                tensor = args[0]                                   # (output, input): output
            else:
                tensor = args[1]                                   # (output, input): input
            records.append((phase[0], name, tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)
        return counted
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _worker(rank, tp, args):
    records, phase = [], ["forward"]
    _record_collectives(records, phase)
    results = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        layer = TensorParallelLayer(args.hidden, args.heads, dist.group.WORLD, sequence_parallel)
        s_local = args.seq // tp if sequence_parallel else args.seq
        x = torch.randn(s_local, args.batch, args.hidden, requires_grad=True)
        records.clear()
        phase[0] = "forward"
        y = layer(x)
        phase[0] = "backward"
        y.backward(torch.randn_like(y))
        results["sp" if sequence_parallel else "no_sp"] = list(records)
    return results


def closed_form(b, s, h, e, tp, sequence_parallel):
    """(tensor bytes, wire bytes per rank) per layer per step."""
    full = b * s * h * e
    if sequence_parallel:
        return 8 * full, 8 * (tp - 1) / tp * full
    return 4 * full, 4 * 2 * (tp - 1) / tp * full


def wire_bytes(op, tensor_bytes, tp):
    return tensor_bytes * (2 if op == "all_reduce" else 1) * (tp - 1) / tp


def report(tp, key, records, args):
    sp = key == "sp"
    counts = Counter((phase, op) for phase, op, _ in records)
    tensor = sum(nbytes for _, _, nbytes in records)
    wire = sum(wire_bytes(op, nbytes, tp) for _, op, nbytes in records)
    theory_tensor, theory_wire = closed_form(args.batch, args.seq, args.hidden, 4, tp, sp)
    calls = ", ".join(f"{phase} {n} x {op}" for (phase, op), n in sorted(counts.items()))
    print(f"TP={tp} SP={'on ' if sp else 'off'}  calls: {calls}")
    print(f"    tensor bytes {tensor:>9,d} / closed form {theory_tensor:>9,d} = "
          f"{tensor / theory_tensor:.3f}    wire bytes per rank {wire:>11,.0f} / closed form "
          f"{theory_wire:>11,.0f} = {wire / theory_wire:.3f}")
    if tensor != theory_tensor or not math.isclose(wire, theory_wire, rel_tol=1e-12):
        raise SystemExit(f"TP={tp} SP={'on' if sp else 'off'}: tensor bytes {tensor:,} "
                         f"(closed form {theory_tensor:,}), wire bytes {wire:,.0f} "
                         f"(closed form {theory_wire:,.0f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = shrink(parser.parse_args(), batch=1, seq=16, hidden=32, heads=4)
    print(f"per transformer layer, one forward + backward, micro-batch b={args.batch} "
          f"s={args.seq} h={args.hidden}, fp32: b*s*h*e = "
          f"{args.batch * args.seq * args.hidden * 4:,d} bytes")
    for tp in args.tp:
        per_rank = launch(tp, _worker, args)
        if any(r != per_rank[0] for r in per_rank):
            raise RuntimeError(f"ranks recorded different collectives at TP={tp}")
        for key in ("no_sp", "sp"):
            report(tp, key, per_rank[0][key], args)
    print("SP: ColumnParallelLinear keeps its gathered input for the weight gradient, so "
          "backward re-gathers nothing (Megatron re-gathers: +2 all-gathers per layer).")


if __name__ == "__main__":
    main()
