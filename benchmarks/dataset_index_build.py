"""Time and peak memory to build the GPT dataset indices of a synthetic 1e9-token dataset.

The index build reads only the sequence lengths, so the dataset is synthesised as 2M
documents with lengths drawn from a seeded generator (mean ~500 tokens). Each figure is
printed next to a reference measured in the same run on the same arrays: a cumsum over
the epochs' document lengths, a memory copy of the document index, and the closed-form
size of the indices. The blending loop is timed next to an empty Python loop.

    python benchmarks/dataset_index_build.py [--documents 2000000] [--seq-length 2048]
        [--epochs 1 10] [--blend-samples 10000000]

SMOKE=1 (benchmarks/common/smoke.py): 2,000 documents, 1,000 blend samples. An index size off its
closed form, or a blend share more than one sample off its weight, exits non-zero.
"""

import argparse
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from benchmarks.common.smoke import shrink
from megalite.data.blended_dataset import build_blending_indices
from megalite.data.gpt_dataset import GPTDataset, build_gpt_indices


class LengthsOnly:
    """An indexed dataset with lengths and no tokens: all the index build reads."""

    def __init__(self, sequence_lengths):
        self.sequence_lengths = sequence_lengths

    def __len__(self):
        return len(self.sequence_lengths)


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def peak_traced(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def max_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def bench_gpt(lengths, document_ids, seq_length, epochs, seed=1234):
    tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (epochs * tokens - 1) // seq_length
    build = lambda: build_gpt_indices(lengths, document_ids, num_samples, seq_length, seed)
    seconds, arrays = timed(build)
    peak = peak_traced(build)
    index_bytes = sum(a.nbytes for a in arrays.values())
    # int32 document index of every epoch, int32 (document, offset) pairs, int32 shuffle
    closed_form = 4 * len(lengths) * epochs + 8 * (num_samples + 1) + 4 * num_samples

    doc_index = arrays["document_index"]
    cumsum_s, _ = timed(lambda: np.cumsum(lengths[doc_index].astype(np.int64)), repeat=3)
    copy_s, _ = timed(lambda: doc_index.copy(), repeat=3)
    shuffle_s, _ = timed(lambda: np.random.RandomState(0).shuffle(doc_index.copy()))

    with tempfile.TemporaryDirectory() as cache:
        dataset = LengthsOnly(lengths)
        miss_s, _ = timed(lambda: GPTDataset(dataset, document_ids, num_samples, seq_length, seed,
                                             name="synthetic", cache_dir=cache))
        hit_s, _ = timed(lambda: GPTDataset(dataset, document_ids, num_samples, seq_length, seed,
                                            name="synthetic", cache_dir=cache), repeat=3)

    mib = 1 / 2**20
    print(f"\n== GPT indices: {tokens / 1e9:.3f}e9 tokens/epoch, {len(lengths):,} documents, "
          f"seq {seq_length}, {epochs} epoch(s) -> {num_samples:,} samples "
          f"({len(arrays['shuffle_index']):,} cut)")
    print(f"build (document+sample+shuffle index)  {seconds:8.3f} s   peak traced {peak * mib:8.1f} MiB")
    print(f"  ref: cumsum of the stream's lengths   {cumsum_s:8.3f} s")
    print(f"  ref: copy of the document index       {copy_s:8.3f} s")
    print(f"  ref: RandomState.shuffle of doc index {shuffle_s:8.3f} s")
    print(f"  indices size {index_bytes * mib:8.1f} MiB (closed form "
          f"4*docs*epochs + 8*(samples+1) + 4*samples = {closed_form * mib:.1f} MiB)")
    print(f"GPTDataset(), cache miss (build+hash+write) {miss_s:8.3f} s")
    print(f"GPTDataset(), cache hit  (hash+mmap load)   {hit_s:8.3f} s")
    if index_bytes != closed_form:
        raise SystemExit(f"{epochs} epoch(s): indices {index_bytes:,} bytes != closed form "
                         f"{closed_form:,}")


def bench_blend(num_samples, weights):
    seconds, out = timed(lambda: build_blending_indices(weights, num_samples))
    empty_s, _ = timed(lambda: [None for _ in range(num_samples)])
    achieved = np.bincount(out["dataset_index"], minlength=len(weights)) / num_samples
    print(f"\n== blending indices: {num_samples:,} samples over weights {weights}")
    print(f"build                    {seconds:8.3f} s  ({seconds / num_samples * 1e9:.0f} ns/sample)"
          f"  output {num_samples * 10 / 2**20:.1f} MiB (10 B/sample)")
    print(f"  ref: empty Python loop {empty_s:8.3f} s")
    print(f"  achieved shares {np.round(achieved, 6).tolist()}")
    off = np.abs(achieved - np.array(weights)) * num_samples
    if off.max() > 1:  # the greedy pick keeps every dataset within one sample of its share
        raise SystemExit(f"blend of {num_samples:,} over {weights}: shares {achieved.tolist()} "
                         f"are up to {off.max():.1f} samples off")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=2_000_000)
    parser.add_argument("--mean-length", type=int, default=500)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--blend-samples", type=int, default=10_000_000)
    args = shrink(parser.parse_args(), documents=2000, seq_length=128, epochs=[1, 3],
                  blend_samples=1000)

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2 * args.mean_length, size=args.documents).astype(np.int32)
    document_ids = np.arange(args.documents)
    print(f"numpy {np.__version__}, {os.cpu_count()} CPUs, max RSS at start {max_rss_mib():.0f} MiB")
    for epochs in args.epochs:
        bench_gpt(lengths, document_ids, args.seq_length, epochs)
    if args.blend_samples:
        bench_blend(args.blend_samples, [0.3, 0.7])
        bench_blend(args.blend_samples // 10, [0.2, 0.3, 0.5])
    print(f"\nmax RSS of the whole run {max_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
