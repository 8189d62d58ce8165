"""Activation memory per rank of one transformer layer under context parallelism, at growing
sequence lengths, against the memory planner (megalite/memory_estimate/).

For each CP in --cp and each sequence length, CP gloo processes build the same model (one
layer is measured: the first of --num-layers) and run one micro-batch's forward through
that layer on their s / CP load-balanced rows; autograd's saved_tensors_hooks record every
tensor saved for backward and the distinct storages are summed (parameters and RoPE's
table are the model's, not activations): what the layer holds from its forward until its
backward, i.e. what piles up per layer and micro-batch in training. The rank holding the
most is reported, next to the planner's figure for the layer (layer_activation_bytes) and
their ratio. The planner's CP working set (the ring's K/V blocks and dK/dV accumulators in
flight, or the gradient of the gathered K/V: one layer's, during its backward) is printed
beside it; it is transient, so saved-tensor hooks cannot see it.

The sequence grows by doubling until CP 1 needs more than --budget-mib for the layer; the
last rows show CP 2 and 4 still fitting. CP 1 runs plain attention (sdpa); --cp-comm-type
all_gather uses sdpa as well, p2p (ring attention) the unfused block kernel (the ring saves
the same tensors on torch's fused kernels, tests/distributed/test_cp_memory_estimate.py).

    python benchmarks/cp_memory.py [--seqs 1024 2048 4096 8192 16384] [--budget-mib 64]

A planned figure off the measured one beyond what docs/benchmarks.md states stops the run
non-zero. SMOKE=1: sequences 64 and 128 against a 2 MiB budget (the CP ranks forked).
"""

import argparse
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.rank_setup import launch
from benchmarks.common.smoke import shrink
import megalite.memory_estimate as me
from megalite.arguments import parse_args
from megalite.memory_estimate.activations import layer_activation_bytes
from megalite.monitoring.memory import SavedActivations
from megalite.parallel_state import ParallelState
from megalite.training import build_model
from megalite.validation import validate_args

MiB = 2 ** 20
MODEL = ["--mock-data", "--vocab-size", "512", "--num-layers", "1", "--hidden-size", "256",
         "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
         "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
         "--attention-dropout", "0", "--hidden-dropout", "0"]


def flags(seq: int, cp: int, comm: str) -> list[str]:
    backend = "unfused" if cp > 1 and comm == "p2p" else "sdpa"
    return [*MODEL, "--seq-length", str(seq), "--context-parallel-size", str(cp),
            "--cp-comm-type", comm, "--attention-backend", backend]


def layer_saved_bytes(config, chunk) -> int:
    m, cp = config.model, config.parallel.context_parallel_size
    x = torch.randn(m.seq_length // cp, config.training.micro_batch_size, m.hidden_size,
                    requires_grad=True)
    with SavedActivations(chunk) as saved:
        chunk.decoder.layers["0"](x, chunk.rope_table(torch.device("cpu")))
    return saved.nbytes


def _worker(rank, cp, seq, comm):
    config = validate_args(parse_args(flags(seq, cp, comm)), cp)
    state = ParallelState(config.parallel.grid, rank)
    chunk = build_model(config, state, torch.device("cpu"), None)[0]
    return layer_saved_bytes(config, chunk)


def measure(cp: int, seq: int, comm: str) -> int:
    """The most any CP rank's layer saves."""
    return max(launch(cp, _worker, seq, comm))


def check(seq: int, cp: int, comm: str, config, planned: int, measured: int):
    """Stop non-zero unless the planner is exact, or, for the ring, exact or high by its
    output counted as a tensor of its own (one [s/CP, b, q] tensor: docs/benchmarks.md)."""
    allowed = {measured}
    if comm == "p2p":
        m = config.model
        allowed.add(measured + m.seq_length // cp * config.training.micro_batch_size
                    * m.query_projection_size * 4)  # fp32
    if planned not in allowed:
        raise SystemExit(f"seq {seq}, CP {cp}, {comm}: planned {planned:,} bytes, "
                         f"measured {measured:,}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=64.0)
    args = shrink(parser.parse_args(), seqs=[64, 128], budget_mib=2.0)
    print(f"one layer (hidden 256, 8 heads, 2 K/V groups, RoPE, SwiGLU, RMSNorm), micro-batch "
          f"1, fp32, CPU; budget {args.budget_mib:g} MiB per rank for the layer")
    print("| seq | CP | comm | measured MiB | planned MiB | planned / measured | "
          "+ working set MiB | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seqs:
        cp1_over = False
        for cp in args.cp:
            for comm in (["-"] if cp == 1 else ["all_gather", "p2p"]):
                measured = measure(cp, seq, "all_gather" if comm == "-" else comm)
                config = validate_args(parse_args(flags(seq, cp, "all_gather" if comm == "-"
                                                        else comm)), cp)
                planned, working = layer_activation_bytes(config, me.DEVICES["cpu"])
                fits = measured <= args.budget_mib * MiB
                cp1_over |= cp == 1 and not fits
                print(f"| {seq} | {cp} | {comm} | {measured / MiB:.2f} | {planned / MiB:.2f} | "
                      f"{planned / measured:.4f} | {working / MiB:.2f} | "
                      f"{'yes' if fits else 'no'} |", flush=True)
                check(seq, cp, comm, config, planned, measured)
        if cp1_over:
            break


if __name__ == "__main__":
    main()
