"""Start-up memory of pretrain's model under FSDP2 against plain DP: what build_model adds
to each rank's peak resident memory, next to the closed forms.

Plain DP builds its whole model on every rank: 4Ψ bytes in fp32. FSDP2 builds it on the
meta device, shards it, and gives each rank its shards' values one parameter at a time:
4Ψ/N plus, at the peak, one parameter's full value (the largest: the embedding) and the
block it is cut from. Each rank is a fresh process (spawned, so nothing is inherited) on
the CPU over gloo; the figure is the rise of its peak RSS (getrusage) across build_model.

    python benchmarks/fsdp_startup_memory.py [--dp 2 4] [--num-layers 8 --hidden-size 1024]
        [--vocab-size 8192]

Peak RSS moves by tens of MiB between runs (allocator, gloo's threads), so the figures
are measurements to read next to the closed forms, not checked against them.
SMOKE=1 (benchmarks/common/smoke.py): 4 layers, hidden 512, vocabulary 1024, DP 2 only.
"""

import argparse
import resource
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.arguments import parse_args
from megalite.parallel_state import ParallelState
from megalite.spawn import run_distributed
from megalite.training import build_model
from megalite.validation import validate_args

MiB = 2 ** 20


def flags(args, fsdp: bool) -> list[str]:
    return ["--mock-data", "--vocab-size", str(args.vocab_size),
            "--num-layers", str(args.num_layers),
            "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
            "--seq-length", "1024", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-4", *(["--use-torch-fsdp2"] if fsdp else [])]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(rank, world, args, fsdp):
    # A tiny model first: the imports and FSDP2's first allocations are not the model.
    warm = argparse.Namespace(num_layers=1, hidden_size=64, vocab_size=128)
    warm_config = validate_args(parse_args(flags(warm, fsdp)), world)
    build_model(warm_config, ParallelState(warm_config.parallel.grid, rank), torch.device("cpu"),
                None)
    config = validate_args(parse_args(flags(args, fsdp)), world)
    before = peak_rss()
    model = build_model(config, ParallelState(config.parallel.grid, rank), torch.device("cpu"),
                        None)
    rise = peak_rss() - before
    # Whole (TP-shard) numbers of elements: DTensor shapes are the unsharded ones.
    sizes = [p.numel() for p in model.parameters()]
    return {"rise": rise, "psi": sum(sizes), "largest": max(sizes)}


def launch(dp: int, args, fsdp: bool) -> list[dict]:
    # Spawned even under SMOKE: a forked rank's RSS counts the parent's pages it touches.
    return run_distributed(dp, worker, args, fsdp, timeout=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = shrink(parser.parse_args(), dp=[2], num_layers=4, hidden_size=512, vocab_size=1024)
    print("| DP | Ψ | plain DP: rise, MiB | 4Ψ | FSDP2: rise, MiB (max over ranks) "
          "| 4Ψ/N + 8·largest | FSDP2 / plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for dp in args.dp:
        plain_ranks, fsdp_ranks = launch(dp, args, False), launch(dp, args, True)
        psi, largest = plain_ranks[0]["psi"], plain_ranks[0]["largest"]
        plain = max(r["rise"] for r in plain_ranks)
        fsdp = max(r["rise"] for r in fsdp_ranks)
        closed = 4 * psi / dp + 8 * largest  # shards + a full value and its block
        print(f"| {dp} | {psi:,} | {plain / MiB:.1f} | {4 * psi / MiB:.1f} | "
              f"{fsdp / MiB:.1f} | {closed / MiB:.1f} | {fsdp / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
