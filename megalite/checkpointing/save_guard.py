"""What a run may do to the checkpoints already in --save (issue #46: a new run saved over
another run's iter_0000002, its retention deleted iteration 4, and the tracker went back
from 6 to 2).

At start-up, before anything is computed, `check_save_directory` refuses a --save that
cannot be written, or that holds checkpoints this run does not resume from, unless
--overwrite-save. While saving, the run's `RunRecord` (kept in each checkpoint's metadata)
says which checkpoints are its own, its past included, and only those are counted and
deleted by --keep-last-n-checkpoints; and the tracker never moves back past a newer
checkpoint (`newer_tracked`), which this run cannot have written: it saves in increasing
order.
"""

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from megalite.atomic_write import unwritable_directory
from megalite.checkpointing import remote
from megalite.checkpointing.storage import (TRACKER_FILENAME, checkpoint_names, read_metadata,
                                           tracked_checkpoint)
from megalite.errors import CheckpointError


@dataclass(frozen=True)
class RunRecord:
    """One launch of a run, as its checkpoints record it (metadata "run")."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    resumed_at: int | None = None
    """The iteration this launch resumed at from --save itself: the checkpoints there up to
    it are the run's past (None: it started from scratch or from elsewhere)."""

    def owns(self, iteration: int, metadata: dict) -> bool:
        """Whether the complete checkpoint of `iteration` in --save is this run's."""
        run = metadata.get("run")
        written = isinstance(run, dict) and run.get("id") == self.id
        return written or (self.resumed_at is not None and iteration <= self.resumed_at)

    @classmethod
    def of(cls, metadata: dict) -> "RunRecord | None":
        """The record a checkpoint's metadata holds; None when it holds none (a tool's)."""
        run = metadata.get("run")
        return cls(run["id"], run.get("resumed_at")) if isinstance(run, dict) else None


def resumes_from_save(ckpt) -> bool:
    """Whether the run (CheckpointConfig `ckpt`) continues what --save holds: --load names
    the same directory and --finetune does not restart at iteration 0."""
    return (ckpt.save is not None and ckpt.load is not None and not ckpt.finetune
            and Path(ckpt.load).resolve() == Path(ckpt.save).resolve())


def check_save_directory(ckpt) -> None:
    """Every rank, before anything is computed: --save is a directory this process can
    write, and holds no checkpoint this run does not resume from (unless --overwrite-save).
    Raises CheckpointError naming the directory, what it holds and the ways out."""
    if ckpt.save is None:
        return
    in_bucket = remote.is_remote(ckpt.save)
    save = ckpt.save if in_bucket else Path(ckpt.save)
    problem = remote.unwritable(save) if in_bucket else unwritable_directory(save)
    if problem is not None:
        raise CheckpointError(f"--save {save}: {problem}")
    held = remote.checkpoint_names(save) if in_bucket else checkpoint_names(save)
    if not held or ckpt.overwrite_save or resumes_from_save(ckpt):
        return
    if ckpt.load is None:
        why = "there is no --load"
    elif ckpt.finetune:
        why = "--finetune restarts at iteration 0"
    else:
        why = f"--load is {ckpt.load}"
    raise CheckpointError(
        f"--save {save} holds checkpoints this run does not resume from ({_describe(save, held)}"
        f"; {why}), and its saves would overwrite them. To resume from them pass --load "
        f"{save}{' without --finetune' if ckpt.finetune else ''}; to save into {save} anyway "
        f"(its other checkpoints kept) pass --overwrite-save; or choose another --save")


def _describe(save: Path | str, held: list[str]) -> str:
    """The tracker's iteration and the checkpoint directories, for the error."""
    found = ("checkpoint directories " if len(held) > 1 else "checkpoint directory ") + \
        ("..., " if len(held) > 3 else "") + ", ".join(held[-3:])
    try:
        if remote.is_remote(save):
            tracked = remote.tracked_iteration(save)
        else:
            tracked = tracked_checkpoint(save)[0] if (save / TRACKER_FILENAME).exists() else None
    except CheckpointError:
        return f"an unreadable tracker; {found}"
    return f"no tracker; {found}" if tracked is None else \
        f"its tracker names iteration {tracked}; {found}"


def newer_tracked(save: str | Path, iteration: int) -> int | None:
    """The tracker's iteration if it names a complete checkpoint newer than `iteration`,
    which this run did not write and the tracker must not move back past; else None (no
    tracker, a garbled one or one naming a missing checkpoint is replaced as before)."""
    if remote.is_remote(save):
        return remote.newer_tracked(save, iteration)
    try:
        tracked, directory = tracked_checkpoint(Path(save))
        read_metadata(directory)
    except CheckpointError:
        return None
    return tracked if tracked > iteration else None
