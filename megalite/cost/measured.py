"""What a cluster check measured that the planner can use, read from its REPORT.md
(tools/check_cluster.py): the MFU of the fastest layout its --tune timed, and the save
rate per rank of its checkpoint phase."""

from dataclasses import dataclass
from pathlib import Path

from megalite.cluster_check import checkpoint, tuning
from megalite.cluster_check.report import read_tables
from megalite.errors import ConfigError


@dataclass(frozen=True)
class Measured:
    mfu: float | None
    """A fraction; None when the report has no tuning table or its MFU is n/a (CPUs)."""
    save_gbps: float | None
    """GB/s one rank wrote; None without a checkpoint phase."""


def read_cluster_report(path: str | Path) -> Measured:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--cluster-report {path}: {e.strerror}") from None
    tuned = read_tables(text, tuning.TITLE)
    # The tuning table's rows are sorted fastest first.
    fastest = tuned[0][0] if tuned and tuned[0] else {}
    saves = [row for rows in read_tables(text, checkpoint.TITLE) for row in rows
             if row.get("") == "save"]
    return Measured(mfu=_number(fastest.get("MFU %"), 0.01),
                    save_gbps=_number(saves[0].get("GB/s per rank") if saves else None))


def _number(cell: str | None, scale: float = 1.0) -> float | None:
    try:
        return float(cell) * scale
    except (TypeError, ValueError):  # absent, or "n/a"
        return None
