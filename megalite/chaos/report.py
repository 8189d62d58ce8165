"""A campaign's oracle and report: every value of a final checkpoint against the fault-free
run's, each fault's outcome, and the tables (Markdown and JSON).

Outcomes:
  survived      the run finished bit-identical, by its restart policy alone (a kind with
                `names` also printed an error naming the fault on the way)
  clear-error   the job stopped with an error naming the fault; after the documented fix
                the run finished bit-identical
  silent        the run finished with a different final state: never allowed
  unclear       the job stopped (or a `names` kind recovered) without an error naming the
                fault
  lost-data     the resume went behind the checkpoint that was durable at the fault, or a
                graceful signal lost steps
  unrecovered   a kind that recovers did not: the run never finished
  incomplete    fired and recovered, but a later fault of its run kept it from finishing
  not-injected  the run ended before the fault's turn
  tool-error    the campaign itself failed in the fault's run (its traceback is printed)
"""

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from megalite.chaos.campaign import Record, names_fault
from megalite.chaos.faults import Fault, KINDS
from megalite.checkpointing.storage import METADATA_FILENAME, flatten, tracked_checkpoint
from megalite.checkpointing.storage import checkpoint_values as storage_values
from megalite.data.indexed_dataset import IndexedDatasetBuilder

FAILURES = ("silent", "unclear", "lost-data", "unrecovered", "incomplete", "tool-error")
# The flags, a checksum over them, and the launch: they differ between the runs compared.
_RUN_SPECIFIC = ("config", "run_file", "checksum", "run")


def build_dataset(prefix: Path, seed: int = 0, documents: int = 300) -> Path:
    """A tiny .bin/.idx of random documents of ids below 60 (NullTokenizer --vocab-size 60)."""
    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16, vocab_size=61)
    for _ in range(documents):
        builder.add_document(rng.integers(0, 60, rng.integers(5, 40)).astype(np.uint16))
    builder.finalize(f"{prefix}.idx")
    return prefix


def checkpoint_values(save: Path) -> dict:
    """Every value of every file of the tracked checkpoint, by file and key path; the
    metadata's too, less the flags."""
    _, directory = tracked_checkpoint(save)
    metadata = json.loads((directory / METADATA_FILENAME).read_text())
    return {**storage_values(directory), **flatten(
        {k: v for k, v in metadata.items() if k not in _RUN_SPECIFIC}, METADATA_FILENAME)}


def differences(a: dict, b: dict) -> list[str]:
    """The keys whose values differ (bit for bit for tensors), or that one side lacks."""
    keys = sorted(a.keys() | b.keys())
    return [k for k in keys if k not in a or k not in b or not _same(a[k], b[k])]


def _same(x, y) -> bool:
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and \
            x.shape == y.shape and torch.equal(_bytes(x), _bytes(y))
    return x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits (NaN equals NaN, -0.0 differs from 0.0)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def classify(records: list[Record], faults: list[Fault], finished: bool,
             different: list[str]) -> None:
    """Each record's outcome (module docstring)."""
    stopped_at = next((r.id for r in records if r.state in ("fired", "resumed", "prelude")),
                      None)
    for record, fault in zip(records, faults):
        kind = fault.kind
        if record.fired_at is None:
            record.outcome = "not-injected"
        elif finished and different:
            record.outcome = "silent"
        elif not finished:
            record.outcome = ("incomplete" if record.id != stopped_at else
                              "clear-error" if not kind.recovers and names_fault(record, fault)
                              else "unrecovered" if kind.recovers else "unclear")
        elif kind.recovers:
            lost = (kind.group == "graceful signal" and record.lost_steps())
            behind = record.durable is not None and record.resumed is not None and \
                record.resumed < record.durable
            record.outcome = ("unclear" if kind.names and not names_fault(record, fault)
                              else "lost-data" if lost or behind else "survived")
        else:
            record.outcome = "clear-error" if record.fixed else "survived"


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record]) -> dict:
    """Per group of kinds and overall: the outcome counts, recovery time median / p95 /
    max, lost steps (median, max)."""
    groups = {}
    for group in dict.fromkeys(k.group for k in KINDS):
        chosen = [r for r in records if r.group == group]
        if chosen:
            groups[group] = _stats(chosen)
    return {"groups": groups, "total": _stats(records)}


def _stats(records: list[Record]) -> dict:
    counts = Counter(r.outcome for r in records)
    recovery = [r.recovery_s() for r in records if r.recovery_s() is not None]
    lost = [r.lost_steps() for r in records if r.lost_steps() is not None
            and r.recovered_at is not None]
    return {"faults": len(records), "outcomes": counts,
            "silent": counts.get("silent", 0),
            "recovery_s": {"median": _percentile(recovery, 50), "p95": _percentile(recovery, 95),
                           "max": max(recovery, default=None)},
            "lost_steps": {"median": _percentile(lost, 50), "max": max(lost, default=None),
                           "total": sum(lost)}}


def markdown(summary: dict, header: str) -> str:
    def shown(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    def row(name, s):
        o = s["outcomes"]
        other = sum(o.get(k, 0) for k in FAILURES if k != "silent")
        r, lost = s["recovery_s"], s["lost_steps"]
        return (f"| {name} | {s['faults']} | {o.get('survived', 0)} | "
                f"{o.get('clear-error', 0)} | {s['silent']} | {other} | "
                f"{o.get('not-injected', 0)} | {shown(r['median'])} / {shown(r['p95'])} / "
                f"{shown(r['max'])} | {shown(lost['median'], '')} / {shown(lost['max'], '')} |")
    lines = [header, "", "| class | faults | survived | clear error | silent | other failures "
             "| not injected | recovery s (median / p95 / max) | lost steps (median / max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [row(name, s) for name, s in summary["groups"].items()]
    lines.append(row("**all**", summary["total"]))
    return "\n".join(lines) + "\n"
