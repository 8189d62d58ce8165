"""Training with and without the document flags on the embedded corpus (issue 41).

    python benchmarks/document_training.py

Builds the corpus (the first --max-documents files of the standard library's source), a
SentencePiece BPE of --vocab-size and its .bin/.idx with end-of-document tokens, then runs
pretrain_gpt.py twice from the same seed: packed samples with causal attention across
documents (the reference, measured in the same run), and with --reset-position-ids
--reset-attention-mask. Prints the documents' lengths against the sequence, and each run's
training loss and validation loss at each evaluation. Everything is written under a
temporary directory, removed at the end.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from benchmarks.common.corpus_training import evaluations, preprocessed, pretrain, training_flags
from benchmarks.common.smoke import shrink
from megalite.data.indexed_dataset import IndexedDataset

FLAGS = ["--reset-position-ids", "--reset-attention-mask"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training_flags(p, seq_length=1024, train_iters=200)
    args = p.parse_args()
    args.tokenizer_model = None  # build_corpus and tokenizer read these
    return shrink(args, max_documents=40, vocab_size=512, seq_length=128, train_iters=4,
                  eval_interval=2, eval_iters=1)


def table(out: str) -> list[tuple[int, float, float]]:
    """(iteration, training loss, validation loss) at each evaluation."""
    return [(log["iteration"], log["lm_loss"], valid) for log, valid in evaluations(out)]


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory() as work:
        prefix, model = preprocessed(args, work)
        lengths = np.asarray(IndexedDataset(prefix).sequence_lengths)
        print(f"{lengths.size} documents, {lengths.sum()} tokens: mean {lengths.mean():.0f}, "
              f"median {np.median(lengths):.0f}; {np.mean(lengths < args.seq_length):.0%} "
              f"shorter than the sequence ({args.seq_length})")
        runs = {"causal across documents (reference)": [], " ".join(FLAGS): FLAGS}
        results = {name: table(pretrain(args, prefix, model, os.path.join(work, f"c{i}"),
                                         extra))
                   for i, (name, extra) in enumerate(runs.items())}
    print("| run | iteration | lm loss | validation loss |\n|---|---:|---:|---:|")
    for name, rows in results.items():
        for iteration, train, valid in rows:
            print(f"| {name} | {iteration} | {train:.4f} | {valid:.4f} |")
    reference, flagged = results.values()
    if [r[0] for r in reference] != [r[0] for r in flagged] or not reference:
        sys.exit("the two runs evaluated at different iterations")
    gap = 100 * (flagged[-1][2] / reference[-1][2] - 1)
    print(f"validation loss with the flags against without, at iteration {reference[-1][0]}: "
          f"{gap:+.2f}%")


if __name__ == "__main__":
    main()
