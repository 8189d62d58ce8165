"""Bytes each rank sends per step within its shard group and across replicas, for ZeRO-1
and FSDP2 (ZeRO-3) at DP 8 with --num-distributed-optimizer-instances N = 1, 2, 4 (HSDP),
next to their closed forms (docs/design.md "Hybrid sharding").

With N replicas of S = DP / N ranks (a shard group: a node, or a few), Ψ parameters and b
bytes per gradient element, ring wire bytes per rank per step (benchmarks/common/wire_bytes.py):

    within the shard group   ZeRO-1: (S-1)/S x Ψ_S (b + b_param)   reduce-scatter + all-gather
                             ZeRO-3: 3 (S-1)/S x Ψ_S b             2 all-gathers + reduce-scatter
    across replicas          2 (N-1)/N x Ψ_S / S x b               all-reduce of this rank's shard

where Ψ_S is Ψ padded to shard boundaries (ZeRO-1: each bucket to a multiple of S; FSDP2:
each parameter's rows to a multiple of S). At N = 1 the shard group is all of DP: on more
than one node every byte of it crosses the nodes' links; under HSDP only the replicas'
all-reduce does, 2(N-1)/N x Ψ/S x b instead of ~2-3 Ψ b. fp32 on the CPU over gloo (b = 4),
one micro-batch per rank; the second step is counted (FSDP2 initialises lazily in the first).

    python benchmarks/hsdp_bytes.py

Each row's measured bytes are checked against the formulas: a mismatch stops the run
non-zero. SMOKE=1 runs DP 2 with N = 1, 2.
"""

import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common import smoke
from benchmarks.common.rank_setup import launch
from benchmarks.common.wire_bytes import counting_wire_bytes
from megalite.distributed.grad_buffer import padded_size
from megalite.layout_check import build_run

FLAGS = ["--mock-data", "--vocab-size", "1024", "--make-vocab-size-divisible-by", "64",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "2",
         "--lr", "1e-3", "--num-workers", "0", "--attention-dropout", "0",
         "--hidden-dropout", "0"]
KINDS = {"ZeRO-1": ["--use-distributed-optimizer"], "FSDP2": ["--use-torch-fsdp2"]}


def worker(rank, world) -> dict:
    """(kind, N) -> (bytes within the shard group, across replicas, parameter shapes) of
    this rank's second step; every layout in one launch."""
    out = {}
    for kind in KINDS:
        for n in replica_counts(world):
            flags = [*FLAGS, *KINDS[kind], "--global-batch-size", str(world),
                     "--num-distributed-optimizer-instances", str(n)]
            _, state, model, _, runner, batches = build_run(flags, world, rank,
                                                            torch.device("cpu"))
            runner.train_step([next(batches)])
            counter = {}
            with counting_wire_bytes(counter):
                runner.train_step([next(batches)])
            across = 0.0 if state.replica_group is None else counter.get(state.replica_group, 0.0)
            out[kind, n] = (counter.get(state.shard_group, 0.0), across,
                            [tuple(p.shape) for p in model.parameters()])
    return out


def replica_counts(dp: int) -> list[int]:
    return [n for n in (1, 2, 4) if n <= dp]


def padded_parameters(kind: str, shapes: list[tuple], s: int) -> int:
    """Ψ_S: ZeRO-1's one bucket (the default bucket holds the whole tiny model) padded to a
    multiple of S; FSDP2's parameters each padded to a multiple of S rows."""
    if kind == "ZeRO-1":
        return padded_size(sum(torch.Size(shape).numel() for shape in shapes), s)
    return sum(-(-shape[0] // s) * s * torch.Size(shape[1:]).numel() for shape in shapes)


def closed_forms(kind: str, psi_s: int, s: int, n: int, b: int = 4) -> tuple[float, float]:
    """(within the shard group, across replicas): the module docstring's formulas, with
    fp32 gradients and parameters (b = b_param = 4)."""
    within = (s - 1) / s * psi_s * (2 * b if kind == "ZeRO-1" else 3 * b)
    return within, 2 * (n - 1) / n * psi_s / s * b


def main():
    dp = 2 if smoke.ON else 8
    if smoke.ON:
        print("SMOKE=1, tiny sizes (not a measurement): DP 2", flush=True)
    kib = 1024.0
    print(f"DP {dp}, fp32, gloo: KiB each rank sends per step (rank 0)")
    print(f"{'layout':>16} {'S':>2} | {'within shard group':>18} {'closed':>9} | "
          f"{'across replicas':>15} {'closed':>9}")
    runs = launch(dp, worker)[0]
    for kind in KINDS:
        for n in replica_counts(dp):
            within, across, shapes = runs[kind, n]
            s = dp // n
            psi_s = padded_parameters(kind, shapes, s)
            closed_within, closed_across = closed_forms(kind, psi_s, s, n)
            name = f"{kind} N {n}" if n > 1 else kind
            print(f"{name:>16} {s:>2} | {within / kib:18.2f} {closed_within / kib:9.2f} | "
                  f"{across / kib:15.2f} {closed_across / kib:9.2f}")
            for what, measured, closed in (("within", within, closed_within),
                                           ("across", across, closed_across)):
                if abs(measured - closed) > 1e-9 * max(closed, 1.0):
                    raise SystemExit(f"{name}: {what} {measured:,.1f} bytes, closed form "
                                     f"{closed:,.1f}")
    print(f"Ψ = {sum(torch.Size(shape).numel() for shape in shapes):,} parameters")


if __name__ == "__main__":
    main()
