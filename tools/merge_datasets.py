"""Merge every prepared .bin/.idx pair in a directory into one, as Megatron-LM's tool does.

    python tools/merge_datasets.py --input data/shards --output-prefix data/merged

The pairs are appended in sorted order of their prefixes (Megatron's order), so merging the
per-file outputs of `preprocess_data.py --output-per-input` gives the bytes that
preprocessing all the input files as one stream gives. The output is `{prefix}.bin/.idx`
(the prefix is the full path without suffix, as Megatron's `--output-prefix` here), written
under temporary names and renamed when complete. Every pair must have the same token dtype.
"""

import argparse
import os
import sys

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.errors import DataError, MegaliteError


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help="directory holding the .bin/.idx pairs to merge")
    parser.add_argument("--output-prefix", required=True,
                        help="path of the merged pair without suffix: writes {prefix}.bin/.idx")
    return parser.parse_args(argv)


def dataset_prefixes(directory):
    """Sorted prefixes of the pairs in `directory`; a .bin or .idx without its mate is an error."""
    if not os.path.isdir(directory):
        raise DataError(f"--input {directory}: directory not found")
    names = {name for name in os.listdir(directory)
             if os.path.isfile(os.path.join(directory, name))}
    prefixes = sorted({os.path.splitext(n)[0] for n in names if n.endswith((".bin", ".idx"))})
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if prefix + suffix not in names:
                raise DataError(f"--input {directory}: {prefix}{suffix} not found "
                                f"(its pair has the other file)")
    if not prefixes:
        raise DataError(f"--input {directory}: no .bin/.idx pairs")
    return [os.path.join(directory, prefix) for prefix in prefixes]


def merge(prefixes, output_prefix):
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(output_prefix + ".bin", dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(output_prefix + ".idx")


def main(argv=None):
    try:
        args = get_args(argv)
        out_dir = os.path.dirname(args.output_prefix) or "."
        if not os.path.isdir(out_dir):
            raise DataError(f"--output-prefix {args.output_prefix}: directory {out_dir} "
                            "not found")
        prefixes = dataset_prefixes(args.input)
        merge(prefixes, args.output_prefix)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
