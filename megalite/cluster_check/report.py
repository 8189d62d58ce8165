"""REPORT.md: a section per phase, under a header that says the launch and the result,
written by rank 0 under a temporary name and renamed; and its tables read back
(tools/estimate_cost.py takes the measured MFU and save rate from them)."""

import itertools
import os
from dataclasses import dataclass, field

from megalite.atomic_write import atomic_write
from megalite.cluster_check.charts import write_charts


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    failed: bool = False
    seconds: float | None = None


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def read_tables(text: str, title: str) -> list[list[dict[str, str]]]:
    """The tables `table` wrote in the section of a REPORT.md whose title starts with
    `title`, each a row per dict (header -> cell), in order."""
    tables, section, lines = [], None, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:]
        elif (section or "").startswith(title) and line.startswith("| ") and \
                i + 1 < len(lines) and lines[i + 1].startswith("|---|"):
            header = _cells(line)
            body = itertools.takewhile(lambda row: row.startswith("| "), lines[i + 2:])
            tables.append([dict(zip(header, _cells(row))) for row in body])
    return tables


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def write_report(output_dir: str, sections: list[Section], charts: dict, header: list[str]):
    os.makedirs(output_dir, exist_ok=True)
    lines = ["# megalite cluster check", ""] + header + [""] + write_charts(output_dir, charts)
    for section in sections:
        took = f" ({section.seconds:.0f} s)" if section.seconds is not None else ""
        lines += [f"## {section.title}{' — FAILED' if section.failed else ''}{took}", ""]
        lines += section.lines + [""]
    text = "\n".join(lines).encode()
    atomic_write(os.path.join(output_dir, "REPORT.md"), lambda f: f.write(text))


def publish(output_dir: str, sections: list[Section], charts: dict, launch: str):
    """Rank 0's end: REPORT.md under `launch` (the ranks, backend, device, time) and the
    result, and every section printed."""
    failed = [s.title for s in sections if s.failed]
    result = "FAILED: " + "; ".join(failed) if failed else "every check passed"
    write_report(output_dir, sections, charts, [launch, f"Result: {result}."])
    for section in sections:
        print("\n".join([f"## {section.title}", *section.lines, ""]), flush=True)
    print(f"report: {os.path.join(output_dir, 'REPORT.md')}", flush=True)
