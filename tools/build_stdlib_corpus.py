"""Write the embedded default corpus: the Python standard library's own source as JSONL.

Every Python install carries ~30 MB of real, varied text in its standard library; one
.py file becomes one {"text": ...} document, in a fixed (sorted) order, so the same
Python version always gives the same corpus. Nothing is downloaded.

    python tools/build_stdlib_corpus.py --output data/stdlib/corpus.jsonl [--max-documents N]
    python tools/build_stdlib_corpus.py --output data/stdlib/parquet --parquet-shards 4

The second writes the same documents as a directory of Parquet shards (a `text` column,
contiguous ranges, `part-00000.parquet` ...), the way FineWeb or DCLM ship (needs pyarrow:
pip install -e .[parquet]).
"""

import argparse
import itertools
import json
import os
import shutil
import sys
import sysconfig

from megalite.atomic_write import atomic_path
from megalite.errors import MegaliteError


def stdlib_sources(root: str | None = None):
    """Paths of the standard library's .py files (site-packages excluded), sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            yield os.path.join(folder, name)


def build_corpus(path: str, max_documents: int | None = None) -> int:
    """Write the corpus to `path` (via a temporary name); returns the document count."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for source in stdlib_sources():
            if max_documents is not None and count >= max_documents:
                break
            # A few stdlib test files hold deliberately invalid UTF-8; keep them readable.
            with open(source, encoding="utf-8", errors="replace") as f:
                out.write(json.dumps({"text": f.read()}) + "\n")
            count += 1
    return count


def build_parquet_shards(directory: str, shards: int, max_documents: int | None = None) -> int:
    """Write the corpus as `shards` Parquet files in `directory` (made complete under a
    temporary name, then renamed); returns the document count."""
    from megalite.data.document_sources import optional_import
    pa = optional_import("pyarrow", "--parquet-shards")
    pq = optional_import("pyarrow.parquet", "--parquet-shards")
    texts = []
    for source in itertools.islice(stdlib_sources(), max_documents):
        with open(source, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    if os.path.isdir(directory) and any(not n.startswith("part-") for n in os.listdir(directory)):
        raise MegaliteError(f"--output {directory}: exists and holds other files than "
                            "Parquet shards; choose a new directory")
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for i in range(shards):
        part = texts[len(texts) * i // shards:len(texts) * (i + 1) // shards]
        pq.write_table(pa.table({"text": part}), os.path.join(tmp, f"part-{i:05d}.parquet"))
    shutil.rmtree(directory, ignore_errors=True)  # an earlier corpus's shards only
    os.replace(tmp, directory)
    return len(texts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--parquet-shards", type=int,
                        help="write a directory --output of this many Parquet shards instead")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    if args.parquet_shards:
        try:
            n = build_parquet_shards(args.output, args.parquet_shards, args.max_documents)
        except MegaliteError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {n} documents in {args.parquet_shards} Parquet shards to {args.output}")
        return 0
    n = build_corpus(args.output, args.max_documents)
    size = os.path.getsize(args.output) / 2 ** 20
    print(f"wrote {n} documents ({size:.1f} MiB) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
