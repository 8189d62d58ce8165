"""pretrain_gpt.py on the embedded corpus, with and without some flags, from the same seed:
what document_training.py and mtp_training.py share (their flags, the corpus preprocessed
with end-of-document tokens, one run, its log lines at each evaluation)."""

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common.preprocess_runs import PREPROCESS, build_corpus, tokenizer
from megalite.training_log import parse_log, parse_validation_line

ROOT = Path(__file__).resolve().parents[2]


def training_flags(parser, seq_length: int, train_iters: int):
    """The flags both benchmarks take; their defaults differ in length only."""
    parser.add_argument("--max-documents", type=int, default=400)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=seq_length)
    parser.add_argument("--train-iters", type=int, default=train_iters)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=10)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)


def preprocessed(args, work: str) -> tuple[str, str]:
    """(data prefix, tokenizer model) of the corpus in `work`, documents ending in EOD."""
    corpus = build_corpus(args, work)
    model = tokenizer(args, corpus, work)
    prefix = os.path.join(work, "stdlib")
    subprocess.run([sys.executable, PREPROCESS, "--input", corpus, "--output-prefix", prefix,
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                    "--append-eod"], check=True, capture_output=True)
    return prefix + "_text_document", model


def pretrain(args, prefix: str, model: str, cache: str, extra: list[str]) -> str:
    """One run's stdout: a 4-head model of args' size, AdamW with a cosine schedule, `extra`
    flags last; exits naming the flags if the run fails."""
    command = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--data-path", prefix,
               "--split", "95,5,0", "--tokenizer-type", "SentencePieceTokenizer",
               "--tokenizer-model", model, "--num-layers", str(args.num_layers),
               "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
               "--seq-length", str(args.seq_length), "--position-embedding-type", "rope",
               "--micro-batch-size", "4", "--global-batch-size", "8",
               "--train-iters", str(args.train_iters), "--lr", "3e-3", "--min-lr", "3e-4",
               "--lr-decay-style", "cosine",
               "--lr-warmup-iters", str(max(1, args.train_iters // 10)),
               "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0",
               "--log-interval", str(args.eval_interval),
               "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
               "--data-cache-path", cache, "--seed", "1234", *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"pretrain_gpt.py {' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def evaluations(out: str) -> list[tuple[dict, float]]:
    """(the log line's fields, the validation loss) at each evaluation during training."""
    logs = {fields["iteration"]: fields for fields in parse_log(out)}
    rows = []
    for line in out.splitlines():
        report = parse_validation_line(line)
        if report and report["prefix"].startswith("iteration ") \
                and report["prefix"][len("iteration "):].strip().isdigit():
            rows.append((logs[int(report["prefix"].split()[1])], report["loss"]))
    return rows
