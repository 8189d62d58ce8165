"""Non-persistent checkpoints (docs/design.md §16): --non-persistent-save-interval with
--non-persistent-ckpt-type local, into --non-persistent-local-ckpt-dir, a directory on each
node's own disk.

Each rank writes one file, `iter_0000100/rank_00003.pt`, of what it holds itself
(CheckpointState.state_dict: its chunks' parameters by their own names, its optimizer
segments, its RNG and the run's position), written whole or not at all
(storage.save_tensor_file). So a local checkpoint loads only at the layout that wrote it,
and only if every rank still has its file: on restart a MIN all-reduce over all ranks
finds the newest iteration every rank holds (`newest_common`), and it is used only when
newer than the persistent checkpoint; otherwise training resumes from --load (so also when
a rank's file is damaged: its zip records against their CRC-32s). A rank keeps
its two newest local saves (a crash between two ranks' writes still leaves a common one)
and drops those a published persistent save makes stale.
"""

from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megalite.checkpointing import remote
from megalite.checkpointing.state import CheckpointState
from megalite.checkpointing.storage import (checkpoint_dir, find_checkpoint_to_load,
                                           iteration_dirs, load_tensor_file, save_tensor_file)
from megalite.errors import CheckpointError

KEEP = 2


def rank_path(root: str | Path, iteration: int, rank: int) -> Path:
    return checkpoint_dir(root, iteration) / f"rank_{rank:05d}.pt"


def _own_iterations(root: str | Path, rank: int) -> list[int]:
    """The iterations this rank has a whole file of, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(i for i in iteration_dirs(root) if rank_path(root, i, rank).is_file())


def save_local(root: str, iteration: int, ckpt: CheckpointState,
               writing: Callable = nullcontext) -> None:
    """Every rank at the same iteration (FSDP2 gathers each parameter): this rank's file,
    written in the context `writing()`."""
    rank = dist.get_rank()
    state = ckpt.state_dict(iteration)
    with writing():
        save_tensor_file(state, rank_path(root, iteration, rank))
    for old in _own_iterations(root, rank)[:-KEEP]:
        _drop(root, old, rank)


def _drop(root: str | Path, iteration: int, rank: int) -> None:
    rank_path(root, iteration, rank).unlink(missing_ok=True)
    with suppress(OSError):  # removed by the last rank of the node to leave it
        checkpoint_dir(root, iteration).rmdir()


def drop_stale(root: str, persistent_iteration: int) -> None:
    """This rank's local saves up to a published persistent one: no longer needed."""
    rank = dist.get_rank()
    for old in _own_iterations(root, rank):
        if old <= persistent_iteration:
            _drop(root, old, rank)


def newest_common(root: str, layout: dict, device: torch.device) -> int | None:
    """Every rank: the newest local iteration every rank holds a file of, written at
    `layout`; None if there is none. Decided by all-reduces, so all ranks agree."""
    rank = dist.get_rank()
    own = _own_iterations(root, rank)
    newest = torch.tensor([own[-1] if own else -1], device=device)
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    candidate = int(newest.item())
    has = torch.tensor([candidate >= 0 and candidate in own], device=device, dtype=torch.int32)
    if has.item():
        try:
            saved = load_tensor_file(rank_path(root, candidate, rank), mmap=True)["layout"]
            has.fill_(int(saved == layout))
        except CheckpointError as damage:  # then --load's checkpoint, on every rank
            print(f" > rank {rank}: {damage}; not resuming from the local checkpoints of "
                  f"iteration {candidate}", flush=True)
            has.fill_(0)
    dist.all_reduce(has, op=dist.ReduceOp.MIN)
    return candidate if has.item() else None


def load_newest(ckpt: CheckpointState, device: torch.device, load_persistent
                ) -> tuple[dict | None, str]:
    """Every rank: the local checkpoint (in --non-persistent-local-ckpt-dir) when every rank
    has one newer than --load's, else `load_persistent()`. Returns what was loaded and
    where from."""
    flags = ckpt.config.checkpoint
    root, load = flags.non_persistent_local_ckpt_dir, flags.load
    if load is not None and remote.is_remote(load):
        tracked = remote.tracked_iteration(load)
        persistent = tracked if isinstance(tracked, int) else -1
    else:
        found = find_checkpoint_to_load(load) if load is not None else None
        persistent = found[0] if found is not None else -1
    local = newest_common(root, ckpt.layout, device)
    if local is not None and local > persistent:
        record = load_tensor_file(rank_path(root, local, dist.get_rank()))
        return ckpt.load_state_dict(record), root
    return (load_persistent() if load is not None else None), load
