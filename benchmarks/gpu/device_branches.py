"""The code that only a GPU runs, and the gpu_check.sh step that runs it (DESIGN.md §19).

    python benchmarks/gpu/device_branches.py      # every tag, by step, with the step's last
                                                  # GPU run (steps.tsv); exit 1 if untagged

A device branch is code that a CPU run does not take: a test of the device kind
(`.type == "cuda"`, `is_available()`), a `torch.cuda.` call, or a CUDA-only kernel
(`record_stream`, `_grouped_mm`, `_scaled_mm` and its fast accumulation). Each carries a tag,
`# gpu_check: <step>[, <step>...]`, at the end of its line or on a comment line directly above
its statement; a tag covers its whole statement (an `if` with its block, a `def` with its
body). tests/test_gpu_registry.py keeps tags, steps.tsv and gpu_check.sh in step.
"""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCANNED = ("megalite", "tools", "pretrain_gpt.py")
DEVICE_CODE = re.compile(
    r"""\.type\s*[!=]=\s*["']cuda["']|["']cuda["']\s*[!=]=|torch\.cuda\.|\bis_available\(\)"""
    r"|\.record_stream\(|_grouped_mm\b|_scaled_mm\b|use_fast_accum")
TAG = re.compile(r"#\s*gpu_check:\s*([\w, ]+)")


def steps() -> dict[str, dict]:
    """steps.tsv: {step: {"tier", "limit", "measured", "run"}} in the order they run."""
    rows = {}
    for line in (HERE / "steps.tsv").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, tier, limit, measured, run = line.split()
            rows[name] = {"tier": tier, "limit": int(limit), "measured": measured, "run": run}
    return rows


def _code_and_comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """{line: the line's code with strings blanked}, {line: its comment}."""
    lines = source.splitlines()
    code = {n: text for n, text in enumerate(lines, 1)}
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
            code[tok.start[0]] = code[tok.start[0]][:tok.start[1]]
        elif tok.type == tokenize.STRING and tok.string[1:-1] != "cuda":
            # a docstring or message may name what it likes; "cuda" compared stays
            (first, col), (last, end) = tok.start, tok.end
            for n in range(first, last + 1):
                text = code[n]
                left = col if n == first else 0
                right = end if n == last else len(text)
                code[n] = text[:left] + " " * (right - left) + text[right:]
    return code, comments


def scan(source: str) -> list[tuple[int, str, list[str]]]:
    """(line, code, the steps its tag names: [] when untagged) per device-branch line."""
    code, comments = _code_and_comments(source)
    statements = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)]
    covered: dict[int, list[str]] = {}
    for line, comment in comments.items():
        tag = TAG.search(comment)
        if not tag:
            continue
        names = [s.strip() for s in tag.group(1).split(",") if s.strip()]
        start = line
        if not code[line].strip():  # a comment line: the statement below it
            start = next((n for n in range(line + 1, len(code) + 1) if code[n].strip()), line)
        spans = [s for s in statements if s.lineno == start] or [None]
        end = max((s.end_lineno for s in spans if s), default=start)
        for n in {*range(start, end + 1), line}:
            covered.setdefault(n, []).extend(x for x in names if x not in covered.get(n, []))
    return [(n, text.strip(), covered.get(n, [])) for n, text in code.items()
            if DEVICE_CODE.search(text)]


def tags() -> dict[str, list[str]]:
    """{step: ["file:line: code", ...]} over megalite/, tools/ and pretrain_gpt.py; the
    untagged lines under the step ""."""
    found: dict[str, list[str]] = {}
    for root in SCANNED:
        path = REPO / root
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for line, text, names in scan(file.read_text()):
                where = f"{file.relative_to(REPO)}:{line}: {text}"
                for name in names or [""]:
                    found.setdefault(name, []).append(where)
    return found


def main() -> int:
    known, found = steps(), tags()
    for name, row in known.items():
        if name in found:
            ran = ("never run on a GPU" if row["measured"] == "-" else
                   f"last GPU run {row['run']} ({row['measured']})")
            print(f"{name} [{row['tier']}; {ran}]")
            print("\n".join(f"    {where}" for where in found[name]))
    for name in sorted(set(found) - set(known) - {""}):
        print(f"{name}: NOT A STEP of gpu_check.sh\n    " + "\n    ".join(found[name]))
    if "" in found:
        print("untagged device branches:\n    " + "\n    ".join(found[""]))
    return 1 if set(found) - set(known) else 0


if __name__ == "__main__":
    sys.exit(main())
