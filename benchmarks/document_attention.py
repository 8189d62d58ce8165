"""Attention forward + backward, causal against block-causal over documents (issue 41;
docs/design.md §28), per backend, next to L/S.

Each case is one core_attention call on q, k, v of [1, seq, heads, head_dim] and its
backward: causal over the whole sequence, and block-causal over documents of mean length L
(lengths uniform in [L/2, 3L/2], seeded; the last one cut at seq). Beside the time ratio
stand L/S and the share of the causal (query, key) pairs the documents keep,
sum l(l+1) / S(S+1), which is what a kernel fed only the documents computes.

CPU (fp32): sdpa (causal calls on padded batches of documents) and unfused (the [b, s, s] mask: the same
work as causal, the reference). GPU (bf16): causal sdpa against sdpa per document, flex
(FlexAttention's block mask) and flash (flash_attn_varlen_func, where flash-attn is
installed). The time is the median of --repeats runs after one warm-up.

    python benchmarks/document_attention.py [--seq 8192] [--mean-lengths 512 2048]

Exits 1 when block-causal sdpa on the CPU is not at least 3x faster than causal at the
shortest mean length (issue 41's bar). SMOKE=1 (benchmarks/common/smoke.py): seq 256,
mean lengths 32 and 128, one run, no bar.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np
import torch

from benchmarks.common.smoke import ON as SMOKE, shrink
from megalite.attention_backends import core_attention, flash_attn_available
from megalite.documents import Documents, starts_from_lengths

BAR = 3.0  # block-causal sdpa at least this much faster than causal on the CPU


def document_lengths(seq: int, mean: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(int(rng.integers(mean // 2, mean + mean // 2 + 1)))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def sync(device: torch.device):
    if device.type != "cpu":  # the CPU ran the call to its end
        torch.accelerator.synchronize(device)


def check_against_sdpa(backend, q, k, v, documents) -> str | None:
    """On a GPU: a document kernel's output against SDPA per document (bf16 round-off)."""
    with torch.no_grad():
        mine = core_attention(q, k, v, backend=backend, documents=documents).float()
        ref = core_attention(q, k, v, backend="sdpa", documents=documents).float()
    diff = (mine - ref).abs().max().item()
    return None if diff <= 2e-2 else f"{backend} differs from sdpa per document by {diff:.3g}"


def timed(backend, q, k, v, grad, documents, repeats: int, device) -> float:
    """Median seconds of one forward + backward."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        core_attention(q, k, v, backend=backend, documents=documents).backward(grad)
        sync(device)
        if i:  # the first run warms the kernels (and compiles flex) up
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return statistics.median(times)


def backends(device) -> list[tuple[str, str]]:
    """(backend for causal, backend for documents) pairs to measure on `device`."""
    if device.type == "cpu":
        return [("sdpa", "sdpa"), ("unfused", "unfused")]
    pairs = [("sdpa", "sdpa"), ("sdpa", "flex")]
    return pairs + ([("flash", "flash")] if flash_attn_available() else [])


def default_device() -> str:
    # gpu_check: document_attention
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mean-lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", help="of those the device runs (default all)")
    parser.add_argument("--device", default=default_device())
    args = shrink(parser.parse_args(argv), seq=256, mean_lengths=[32, 128], repeats=1)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = (1, args.seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    print(f"attention fwd+bwd, seq {args.seq}, {args.heads} heads x {args.head_dim}, {dtype}, "
          f"{device.type}; median of {args.repeats}")
    print(f"{'backend':>15} {'mean L':>7} {'causal s':>9} {'documents s':>12} {'speed-up':>9} "
          f"{'S/L':>6} {'pairs kept':>11}")
    failed = False
    for causal_backend, document_backend in backends(device):
        if args.backends and document_backend not in args.backends:
            continue
        causal = timed(causal_backend, q, k, v, grad, None, args.repeats, device)
        for mean in args.mean_lengths:
            lengths = document_lengths(args.seq, mean)
            starts = starts_from_lengths(lengths, args.seq)[None].to(device)
            documents = Documents(starts, torch.arange(args.seq, device=device))
            problem = (check_against_sdpa(document_backend, q, k, v, documents)
                       if device.type != "cpu" else None)
            if problem:
                print(f"FAIL: {problem}")
                failed = True
            blocked = timed(document_backend, q, k, v, grad, documents, args.repeats, device)
            kept = sum(n * (n + 1) for n in lengths) / (args.seq * (args.seq + 1))
            name = document_backend if causal_backend == document_backend else \
                f"{causal_backend}/{document_backend}"
            print(f"{name:>15} {mean:>7} {causal:>9.3f} {blocked:>12.3f} {causal / blocked:>8.1f}x "
                  f"{args.seq / mean:>6.1f} {kept:>11.3f}", flush=True)
            if (device.type == "cpu" and document_backend == "sdpa" and not SMOKE
                    and mean == min(args.mean_lengths) and causal / blocked < BAR):
                print(f"FAIL: block-causal sdpa {causal / blocked:.1f}x faster than causal at "
                      f"mean length {mean}, below the bar of {BAR}x")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
