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
import sys
import tempfile
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.corpus_training import evaluations, preprocessed, pretrain, training_flags
from benchmarks.common.smoke import shrink

MODEL = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
FLAGS = ["--mtp-num-layers", "1"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training_flags(p, seq_length=256, train_iters=300)
    args = p.parse_args()
    args.tokenizer_model = None  # build_corpus and tokenizer read these
    return shrink(args, max_documents=40, vocab_size=512, seq_length=64, train_iters=4,
                  eval_interval=2, eval_iters=1)


def table(out: str) -> list[tuple[int, float, float | None, float, float]]:
    """(iteration, training lm loss, mtp_1 loss or None, validation loss, ms per iteration)
    at each evaluation."""
    return [(log["iteration"], log["lm_loss"], (log["mtp_losses"] or {}).get("1"), valid,
             log["elapsed_ms"]) for log, valid in evaluations(out)]


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory() as work:
        prefix, model = preprocessed(args, work)
        runs = {"no MTP (reference)": [], " ".join(FLAGS): FLAGS}
        results = {name: table(pretrain(args, prefix, model, os.path.join(work, f"c{i}"),
                                         MODEL + extra))
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
