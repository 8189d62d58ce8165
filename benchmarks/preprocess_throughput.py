"""Throughput and peak memory of tools/preprocess_data.py on the embedded corpus.

The corpus is the Python standard library's own source (one .py file = one document,
~30 MB, nothing downloaded). A SentencePiece BPE tokenizer is trained on it with
tools/train_tokenizer.py unless --tokenizer-model is given. The tool then runs at each
--workers count, and each figure is printed next to references measured in the same run:
reading the input file (page cache, 1 MiB blocks) and the plain SentencePiece encode of
every document in one process (json.loads + encode_as_ids, no output) -- the work one
worker does, without the reading, ordering and writing around it.

    python benchmarks/preprocess_throughput.py [--workers 1 2] [--repeat 2]
        [--tokenizer-model tok.model] [--vocab-size 8000] [--workdir DIR] [--max-documents N]

SMOKE=1 (benchmarks/common/smoke.py): 50 documents, a 500-piece tokenizer, one run each.
Outputs that differ between worker counts exit non-zero.
"""

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.preprocess_runs import build_corpus, corpus_flags, run_tool, tokenizer
from benchmarks.common.smoke import shrink


def read_speed(path):
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    return os.path.getsize(path) / (time.perf_counter() - start)


def encode_speed(path, model):
    """(seconds, CPU seconds, tokens) to encode every document in this process."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    with open(path, "rb") as f:
        for line in f:
            tokens += len(sp.encode_as_ids(json.loads(line)["text"]))
    return time.perf_counter() - start, time.process_time() - cpu, tokens


def cpu_scaling(processes):
    """Speed of `processes` busy processes relative to one: what parallel work can gain here
    (below `processes` when other jobs share the cores)."""
    with multiprocessing.Pool(processes) as pool:
        pool.map(_spin, [1] * processes)  # start-up out of the timing
        start = time.perf_counter()
        pool.map(_spin, [0.5] * processes)
        parallel = time.perf_counter() - start
    start = time.perf_counter()
    _spin(0.5)
    return processes * (time.perf_counter() - start) / parallel


def _spin(seconds_of_work):
    n = int(seconds_of_work * 2e7)
    return sum(i * i for i in range(n))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    corpus_flags(parser, repeat=2)
    parser.add_argument("--workdir", help="keep corpus and outputs here (default: a temp dir)")
    args = shrink(parser.parse_args(), max_documents=50, vocab_size=500, repeat=1)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        report(args, work)


def report(args, work):
    corpus = build_corpus(args, work)
    with open(corpus) as f:
        docs = sum(1 for _ in f)  # one JSON document a line
    mb = os.path.getsize(corpus) / 2**20
    print(f"corpus: {docs} documents, {mb:.1f} MiB ({sys.version.split()[0]} stdlib)")
    start = time.perf_counter()
    model = tokenizer(args, corpus, work)
    if args.tokenizer_model is None:
        print(f"tokenizer: trained BPE {args.vocab_size} in {time.perf_counter() - start:.1f} s")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          + ", ".join(f"{n} busy processes run {cpu_scaling(n):.2f}x one"
                      for n in sorted(set(args.workers)) if n > 1))
    print(f"reference: read input                {read_speed(corpus) / 2**20:8.1f} MB/s")
    wall, cpu, tokens = encode_speed(corpus, model)
    print(f"reference: sentencepiece, 1 process  {mb / wall:8.2f} MB/s, {docs / wall:7.1f} "
          f"docs/s, {wall:5.1f} s, {cpu:5.1f} CPU s ({tokens} tokens)")
    outputs = {}
    for workers in args.workers:
        prefix = os.path.join(work, f"out_w{workers}")
        wall, cpu, rss = min(run_tool(corpus, model, prefix, workers)
                             for _ in range(args.repeat))
        print(f"preprocess_data.py --workers {workers}:  {mb / wall:8.2f} MB/s, "
              f"{docs / wall:7.1f} docs/s, {wall:5.1f} s, {cpu:5.1f} CPU s, "
              f"peak RSS {rss:.0f} MiB per process")
        outputs[workers] = [open(prefix + "_text_document" + ext, "rb").read()
                            for ext in (".bin", ".idx")]
    same = all(out == next(iter(outputs.values())) for out in outputs.values())
    print(f"outputs identical across --workers {args.workers}: {same}")
    if not same:
        raise SystemExit(f"preprocess_data.py outputs differ between --workers {args.workers}")


if __name__ == "__main__":
    main()
