"""Write the embedded default corpus: the Python standard library's own source as JSONL.

Every Python install carries ~30 MB of real, varied text in its standard library; one
.py file becomes one {"text": ...} document, in a fixed (sorted) order, so the same
Python version always gives the same corpus. Nothing is downloaded.

    python tools/build_stdlib_corpus.py --output data/stdlib/corpus.jsonl [--max-documents N]
"""

import argparse
import json
import os
import sys
import sysconfig

from megalite.atomic_write import atomic_path


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-documents", type=int, default=None)
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    n = build_corpus(args.output, args.max_documents)
    size = os.path.getsize(args.output) / 2 ** 20
    print(f"wrote {n} documents ({size:.1f} MiB) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
