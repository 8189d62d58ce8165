"""tools/preprocess_data.py on the embedded corpus (the Python standard library's own
source, built by tools/build_stdlib_corpus.py), for preprocess_throughput.py and
preprocess_formats.py: their flags, the corpus, its tokenizer and a timed run of the tool."""

import os
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
PREPROCESS = str(TOOLS / "preprocess_data.py")

# Runs a command, then prints the peak RSS (KiB) of the largest process it started (the
# tool's parent or one of its workers) and the CPU seconds of all of them together:
# RUSAGE_CHILDREN covers every waited-for descendant.
RUSAGE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
          "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
          "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
          "print(r.ru_maxrss, r.ru_utime + r.ru_stime)")


def corpus_flags(parser, repeat):
    """The flags both benchmarks take."""
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=repeat,
                        help="runs per setting; best is kept")
    parser.add_argument("--tokenizer-model", help="skip training; use this SentencePiece model")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-documents", type=int, help="the first N (default: all)")


def build_corpus(args, work: str) -> str:
    """The corpus as JSONL in `work` (--max-documents of it); its path."""
    corpus = os.path.join(work, "stdlib.jsonl")
    subprocess.run([sys.executable, str(TOOLS / "build_stdlib_corpus.py"), "--output", corpus,
                    *([] if args.max_documents is None else
                      ["--max-documents", str(args.max_documents)])],
                   check=True, capture_output=True)
    return corpus


def tokenizer(args, corpus: str, work: str) -> str:
    """--tokenizer-model, else a BPE of --vocab-size trained on `corpus` in `work`."""
    if args.tokenizer_model is not None:
        return args.tokenizer_model
    subprocess.run([sys.executable, str(TOOLS / "train_tokenizer.py"), "--input", corpus,
                    "--model-prefix", os.path.join(work, "tok"), "--vocab-size",
                    str(args.vocab_size)], check=True, capture_output=True)
    return os.path.join(work, "tok.model")


def measured(command: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in MiB) of `command`."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RUSAGE, *command], check=True,
                         capture_output=True, text=True).stdout
    rss, cpu = out.split()
    return time.perf_counter() - start, float(cpu), int(rss) / 1024


def run_tool(corpus, model, prefix, workers) -> tuple[float, float, float]:
    """measured() of one preprocess_data.py run."""
    return measured([sys.executable, PREPROCESS, "--input", corpus, "--output-prefix", prefix,
                     "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                     "--append-eod", "--workers", str(workers), "--log-interval", "100000"])
