"""Training with and without multi-token prediction on the embedded corpus (issue 43).

    python benchmarks/mtp_training.py

Builds the corpus (the first --max-documents files of the standard library's source), a
SentencePiece BPE of --vocab-size and its .bin/.idx, then runs pretrain_gpt.py twice from
the same seed for the same steps: without MTP (the reference, measured in the same run) and
with --mtp-num-layers 1 (--mtp-loss-scaling-factor at Megatron's 0.1). Prints each run's
training lm loss, its mtp_1 loss, the validation lm loss at each evaluation (the main head
in both: MTP adds to the gradient only), and the time per iteration. Everything is written
under a temporary directory, removed at the end.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.preprocess_runs import PREPROCESS, build_corpus, tokenizer
from benchmarks.common.smoke import shrink
from megalite.training_log import parse_log, parse_validation_line

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--mtp-num-layers", "1"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-documents", type=int, default=400)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    args = p.parse_args()
    args.tokenizer_model = None  # build_corpus and tokenizer read these
    return shrink(args, max_documents=40, vocab_size=512, seq_length=64, train_iters=4,
                  eval_interval=2, eval_iters=1)


def pretrain(args, prefix: str, model: str, cache: str, extra: list[str]) -> str:
    command = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--data-path", prefix,
               "--split", "95,5,0", "--tokenizer-type", "SentencePieceTokenizer",
               "--tokenizer-model", model, "--num-layers", str(args.num_layers),
               "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
               "--seq-length", str(args.seq_length), "--position-embedding-type", "rope",
               "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
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


def table(out: str) -> list[tuple[int, float, float | None, float, float]]:
    """(iteration, training lm loss, mtp_1 loss or None, validation loss, ms per iteration)
    at each evaluation."""
    logs = {fields["iteration"]: fields for fields in parse_log(out)}
    rows = []
    for line in out.splitlines():
        report = parse_validation_line(line)
        if report and report["prefix"].startswith("iteration ") \
                and report["prefix"][len("iteration "):].strip().isdigit():
            log = logs[int(report["prefix"].split()[1])]
            mtp = (log["mtp_losses"] or {}).get("1")
            rows.append((log["iteration"], log["lm_loss"], mtp, report["loss"],
                         log["elapsed_ms"]))
    return rows


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory() as work:
        corpus = build_corpus(args, work)
        model = tokenizer(args, corpus, work)
        prefix = os.path.join(work, "stdlib")
        subprocess.run([sys.executable, PREPROCESS, "--input", corpus, "--output-prefix",
                        prefix, "--tokenizer-type", "SentencePieceTokenizer",
                        "--tokenizer-model", model, "--append-eod"], check=True,
                       capture_output=True)
        prefix += "_text_document"
        runs = {"no MTP (reference)": [], " ".join(FLAGS): FLAGS}
        results = {name: table(pretrain(args, prefix, model, os.path.join(work, f"c{i}"),
                                         extra))
                   for i, (name, extra) in enumerate(runs.items())}
    print("| run | iteration | lm loss | mtp_1 loss | validation loss | ms/iteration |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        for iteration, train, mtp, valid, ms in rows:
            mtp = "" if mtp is None else f"{mtp:.4f}"
            print(f"| {name} | {iteration} | {train:.4f} | {mtp} | {valid:.4f} | {ms:.0f} |")
    reference, with_mtp = results.values()
    if [r[0] for r in reference] != [r[0] for r in with_mtp] or not reference:
        sys.exit("the two runs evaluated at different iterations")
    if any(r[2] is None for r in with_mtp):
        sys.exit("the MTP run's log lines lack the mtp_1 loss")
    gap = 100 * (with_mtp[-1][3] / reference[-1][3] - 1)
    print(f"validation loss with MTP against without, at iteration {reference[-1][0]}: "
          f"{gap:+.2f}%")


if __name__ == "__main__":
    main()
