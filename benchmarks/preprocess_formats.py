"""tools/preprocess_data.py on each input format, next to JSONL, and its peak memory on an
input larger than that memory.

The embedded corpus (benchmarks/preprocess_throughput.py: the standard library's source as
JSONL) is written as .jsonl.gz, .jsonl.zst, 4 Parquet shards and a datasets save_to_disk
directory (4 Arrow shards); the tool runs on each at every --workers count. MB/s are of the
JSONL bytes, so every format's figure is the same documents per second; every output must be
byte-identical to the JSONL one (else exit 1). Then a Parquet file holding --memory-input-mb
of text (mostly spaces, so tokenizing is cheap and reading dominates) is preprocessed with a
NullTokenizer, and the peak RSS of the largest process is printed next to the input size.

    python benchmarks/preprocess_formats.py [--workers 1 2] [--repeat 1]
        [--tokenizer-model tok.model] [--max-documents N] [--memory-input-mb 1024]

SMOKE=1 (benchmarks/common/smoke.py): 30 documents, a 500-piece tokenizer, 1 worker, 8 MB of
memory input.
"""

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.preprocess_runs import (PREPROCESS, build_corpus, corpus_flags, measured,
                                               run_tool, tokenizer)
from benchmarks.common.smoke import shrink


def write_formats(corpus, work):
    """{format: --input path} holding the corpus's documents in its order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    data = open(corpus, "rb").read()
    texts = [json.loads(line)["text"] for line in data.splitlines()]
    inputs = {"jsonl": corpus, "jsonl.gz": os.path.join(work, "corpus.jsonl.gz"),
              "jsonl.zst": os.path.join(work, "corpus.jsonl.zst"),
              "parquet": os.path.join(work, "parquet"), "arrow": os.path.join(work, "arrow")}
    with open(inputs["jsonl.gz"], "wb") as f:
        f.write(gzip.compress(data, compresslevel=6))
    with open(inputs["jsonl.zst"], "wb") as f:
        f.write(zstandard.ZstdCompressor(level=3).compress(data))
    os.makedirs(inputs["parquet"], exist_ok=True)
    for i in range(4):
        part = texts[len(texts) * i // 4:len(texts) * (i + 1) // 4]
        pq.write_table(pa.table({"text": part}),
                       os.path.join(inputs["parquet"], f"part-{i:05d}.parquet"))
    import datasets
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(inputs["arrow"], num_shards=4)
    return inputs


def outputs_of(prefix):
    return [open(prefix + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")]


def throughput(args, work, corpus, model):
    mb = os.path.getsize(corpus) / 2**20
    docs = sum(1 for _ in open(corpus, "rb"))
    inputs = write_formats(corpus, work)
    reference, same = None, True
    print(f"{'input':10} {'workers':>7} {'MB/s':>8} {'docs/s':>8} {'wall s':>7} {'CPU s':>7} "
          f"{'peak RSS':>9}")
    for workers in args.workers:
        for fmt, path in inputs.items():
            prefix = os.path.join(work, f"out_{fmt}_w{workers}")
            wall, cpu, rss = min(run_tool(path, model, prefix, workers)
                                 for _ in range(args.repeat))
            print(f"{fmt:10} {workers:7d} {mb / wall:8.2f} {docs / wall:8.1f} {wall:7.1f} "
                  f"{cpu:7.1f} {rss:6.0f} MiB", flush=True)
            reference = reference or outputs_of(prefix)
            same &= outputs_of(prefix) == reference
    print(f"every output byte-identical to the JSONL one: {same}")
    return same


def memory(args, work):
    """Peak RSS of the largest process on a Parquet input of --memory-input-mb of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    size, rows = 20_000, args.memory_input_mb * 2**20 // 20_000
    text = " " * (size - 5) + "1 2 3"
    path = os.path.join(work, "big.parquet")
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="zstd") as w:
        for start in range(0, rows, 1000):
            w.write_table(pa.table({"text": [text] * min(1000, rows - start)}))
    cmd = [sys.executable, PREPROCESS, "--input", path, "--output-prefix",
           os.path.join(work, "big"), "--tokenizer-type", "NullTokenizer", "--vocab-size",
           "10", "--workers", "2", "--log-interval", "1000000"]
    wall, _, rss = measured(cmd)
    print(f"memory: {rows * size / 2**20:.0f} MiB of text ({rows} documents; "
          f"{os.path.getsize(path) / 2**20:.2f} MiB of Parquet), --workers 2: peak RSS "
          f"{rss:.0f} MiB per process, {wall:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    corpus_flags(parser, repeat=1)
    parser.add_argument("--memory-input-mb", type=int, default=1024)
    args = shrink(parser.parse_args(), max_documents=30, vocab_size=500, repeat=1,
                  memory_input_mb=8, workers=[1])
    with tempfile.TemporaryDirectory() as work:
        corpus = build_corpus(args, work)
        model = tokenizer(args, corpus, work)
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
              f"corpus {os.path.getsize(corpus) / 2**20:.1f} MiB of JSONL")
        same = throughput(args, work, corpus, model)
        memory(args, work)
    if not same:
        raise SystemExit("an input format gave other bytes than JSONL")


if __name__ == "__main__":
    main()
