"""Size and unigram entropy of an indexed dataset (.bin/.idx).

The unigram entropy H = -sum p(t) ln p(t) over the token frequencies is the loss (nats per
token) of the best model that ignores context: a language model that learned anything from
context must go below it.

    python tools/dataset_stats.py --data-path data/stdlib/stdlib_text_document
"""

import argparse
import sys

import numpy as np

from megalite.data.indexed_dataset import IndexedDataset
from megalite.errors import MegaliteError


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequency distribution."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", required=True, help="dataset prefix (without .bin/.idx)")
    args = parser.parse_args(argv)
    try:
        ds = IndexedDataset(args.data_path)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.data_path}: {len(ds.document_indices) - 1} documents, {len(ds)} sequences, "
          f"{len(ds.tokens)} tokens, unigram entropy {unigram_entropy(ds.tokens):.4f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
