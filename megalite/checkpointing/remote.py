"""Checkpoints in a bucket (`--save s3://bucket/run`, docs/design.md §30): storage.py's layout
and rules, over objects.

The same names as on disk: `<save>/iter_0000100/<file>`, `<save>/iter_0000100/metadata.json`,
`<save>/latest_checkpointed_iteration.txt`. An object store has no rename, so a checkpoint
becomes visible in the order of its objects:
  1. rank 0 `begin` deletes what a crashed save of the same iteration left (metadata.json
     first); every rank writes its files into a node-local staging directory with
     storage.py's code (the same bytes), then `upload`s them in parallel;
  2. every rank's (size, CRC-32) records are gathered (`gather_uploads`), and rank 0
     `commit`s: a HEAD of every expected object must match its record, then metadata.json
     is written, then the tracker (each a single PUT: a reader sees the old object or the
     new one);
  3. a reader (`fetch`) starts from the tracker: without it nothing is loaded, and a
     checkpoint without metadata.json is incomplete. Files are downloaded into the node's
     cache, checked against their recorded size and CRC-32, and then loaded by storage.py
     as local files (their zip records against torch.save's CRC-32s too).
"""

import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import torch.distributed as dist

from megalite.atomic_write import atomic_write
from megalite.checkpointing.storage import (METADATA_FILENAME, RELEASE, TRACKER_FILENAME,
                                           checkpoint_dir, metadata_bytes, parse_metadata,
                                           parse_tracker, retired, staging_dir)
from megalite.errors import CheckpointError, StorageError
from megalite.object_storage.paths import is_object_url, mirror_path, node_share
from megalite.object_storage.s3 import CONCURRENCY, ObjectRecord, S3Store, S3Url, file_record

is_remote = is_object_url


def cache_of(config) -> str | None:
    """--object-storage-cache-path of a run's Config (tools have no data section)."""
    return config.data.object_storage_cache_path if config.data is not None else None


def _dir_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else checkpoint_dir("", iteration).name


def local_staging(save: str, iteration: int, cache: str | None) -> Path:
    """Where every rank of a node writes its files of `save`'s `iteration` before upload."""
    return staging_dir(mirror_path(save, cache), iteration)


# --- saving ----------------------------------------------------------------------------------

def begin(save: str, iteration: int, cache: str | None) -> None:
    """Rank 0, before any rank writes: no object of a crashed save of `iteration` left to be
    mixed into this one (metadata.json first: the checkpoint stops being complete), and an
    empty local staging directory."""
    store, url = S3Store.shared(), S3Url.parse(save)
    store.delete(url.join(_dir_name(iteration), METADATA_FILENAME))
    store.delete_under(url.join(_dir_name(iteration)))
    staging = local_staging(save, iteration, cache)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)


def upload(save: str, iteration: int, staging: Path, names: list[str]
           ) -> dict[str, ObjectRecord]:
    """Any rank: its files `names` from `staging` to `save`'s `iteration`, in parallel
    (each large one in parts), then removed locally. Raises StorageError naming the
    object that could not be written."""
    store, directory = S3Store.shared(), S3Url.parse(save).join(_dir_name(iteration))
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        records = dict(zip(names, pool.map(
            lambda name: store.upload(staging / name, directory.join(name)), names)))
    for name in names:
        (staging / name).unlink(missing_ok=True)
    with suppress(OSError):  # removed by the node's last uploader; commit removes rank 0's
        staging.rmdir()
    return records


def gather_uploads(records: dict | None, error: str | None, group=None) -> dict:
    """Every rank: every rank's upload records, merged; a CheckpointError on every rank,
    naming the failure, if any rank's upload failed."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (records, error), group=group)
    errors = [(rank, e) for rank, (_, e) in enumerate(gathered) if e]
    if errors:
        rank, first = errors[0]
        raise CheckpointError(f"rank {rank}: {first}" + (f" (and {len(errors) - 1} more ranks)"
                                                         if len(errors) > 1 else ""))
    return {name: record for r, _ in gathered for name, record in (r or {}).items()}


def commit(save: str, iteration: int, metadata: dict, expected: list[str],
           uploads: dict[str, ObjectRecord], track: bool, cache: str | None) -> None:
    """Rank 0, once every rank has uploaded: confirm, then metadata.json, then the tracker
    (unless not `track`, as storage.commit)."""
    store, url = S3Store.shared(), S3Url.parse(save)
    directory = url.join(_dir_name(iteration))
    found = {name: store.head(directory.join(name)) for name in expected}
    wrong = [f"{name} ({_difference(uploads.get(name), found[name])})" for name in expected
             if uploads.get(name) is None or found[name] != uploads[name]]
    if wrong:
        raise CheckpointError(f"cannot commit checkpoint {directory}: {len(wrong)} of "
                              f"{len(expected)} objects missing or not as uploaded: {wrong}")
    store.put(directory.join(METADATA_FILENAME), metadata_bytes(metadata, iteration, expected))
    if track:
        store.put(url.join(TRACKER_FILENAME), str(iteration).encode())
    shutil.rmtree(local_staging(save, iteration, cache), ignore_errors=True)


def _difference(uploaded: ObjectRecord | None, found: ObjectRecord | None) -> str:
    if uploaded is None:
        return "no rank uploaded it"
    if found is None:
        return "absent from the bucket"
    return f"uploaded {uploaded.size} bytes of CRC-32 {uploaded.crc32}, found {found.size} " \
           f"bytes of CRC-32 {found.crc32 or '(none)'}"


def apply_retention(save: str, keep: int, owns) -> None:
    """storage.apply_retention in a bucket: the same checkpoints kept (storage.retired).
    Incomplete ones (no metadata.json) are left alone, as on disk."""
    tracked = tracked_iteration(save)
    if keep <= 0 or tracked is None:
        return
    complete = {i: meta for i in checkpoint_iterations(save)
                if (meta := _metadata(save, i)) is not None}
    for i in retired(complete, tracked, keep, owns):
        S3Store.shared().delete_under(S3Url.parse(save).join(_dir_name(i)))


def checkpoint_iterations(save: str) -> list[int]:
    """The iterations of `iter_*` "directories" under `save`, complete or not."""
    names = S3Store.shared().list_names(S3Url.parse(save), directories=True)
    return sorted(int(n[5:]) for n in names if n.startswith("iter_") and n[5:].isdigit())


def checkpoint_names(save: str) -> list[str]:
    """storage.checkpoint_names in a bucket."""
    return [_dir_name(i) for i in checkpoint_iterations(save)]


def unwritable(save: str) -> str | None:
    """Why this process cannot write objects under `save` (credentials, bucket, endpoint),
    or None: an empty object is written and deleted, before any work."""
    probe = S3Url.parse(save).join(f".megalite-write-probe-{uuid.uuid4().hex}")
    store = S3Store.shared()
    try:
        store.put(probe, b"")
        store.delete(probe)
    except StorageError as error:
        return str(error)
    return None


def tracked_iteration(save: str) -> int | str | None:
    """The iteration the tracker names (RELEASE for Megatron's), or None without one."""
    tracker = S3Url.parse(save).join(TRACKER_FILENAME)
    data = S3Store.shared().get(tracker)
    return None if data is None else parse_tracker(data, tracker)


def _metadata(save: str, iteration: int) -> dict | None:
    """The record of `save`'s complete checkpoint of `iteration`, else None."""
    path = S3Url.parse(save).join(_dir_name(iteration), METADATA_FILENAME)
    try:
        data = S3Store.shared().get(path)
        return None if data is None else parse_metadata(data, path)
    except (CheckpointError, StorageError):
        return None


def newer_tracked(save: str, iteration: int) -> int | None:
    """save_guard.newer_tracked in a bucket."""
    tracked = tracked_iteration(save)
    if not isinstance(tracked, int) or tracked <= iteration:
        return None
    return tracked if _metadata(save, tracked) is not None else None


# --- loading ---------------------------------------------------------------------------------

def fetch(load: str, cache: str | None, iteration: int | None = None, part: int = 0,
          parts: int = 1) -> Path | None:
    """Any process: `load`'s tracked checkpoint (or `iteration`'s) into the node's cache,
    returned as a local directory storage.py loads from (its tracker and the checkpoint);
    None when `load` holds no checkpoint at all. With `parts` processes on a node each
    downloads its `part` of the files (the caller waits for all of them)."""
    store, url, root = S3Store.shared(), S3Url.parse(load), mirror_path(load, cache)
    if iteration is None:
        iteration = tracked_iteration(load)
        if iteration is None:
            held = checkpoint_iterations(load)
            if not held:
                return None
            raise CheckpointError(
                f"checkpoint tracker {url.join(TRACKER_FILENAME)} is missing but {load} holds "
                f"checkpoints of iterations {held[-3:]}: a checkpoint is never loaded without "
                f"its tracker (the save that wrote it may not have finished); write the "
                f"iteration to resume from into it, or point --load elsewhere")
        _write(root / TRACKER_FILENAME, str(iteration).encode())
    directory = url.join(_dir_name(iteration))
    data = store.get(directory.join(METADATA_FILENAME))
    if data is None:
        raise CheckpointError(f"incomplete checkpoint {directory}: no {METADATA_FILENAME} (the "
                              f"save did not finish); it is never loaded")
    files = parse_metadata(data, directory.join(METADATA_FILENAME)).get("files")
    local = root / _dir_name(iteration)
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        files = []  # storage.read_metadata names the problem
    escaping = [f for f in files if Path(f).is_absolute() or ".." in Path(f).parts]
    if escaping:  # never written outside the cache
        raise CheckpointError(f"checkpoint metadata {directory.join(METADATA_FILENAME)}: file "
                              f"names must be relative to the checkpoint, got {escaping}")
    for name in files[part::parts]:
        path, source = local / name, directory.join(name)
        if not (path.is_file() and store.head(source) == file_record(path)):  # not cached
            store.download(source, path)
    _write(local / METADATA_FILENAME, data)
    return root


def _write(path: Path, data: bytes) -> None:
    """Whole, under a name of this process's own (the node's ranks write the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(data), suffix=f".{os.getpid()}.tmp")


def fetch_for_ranks(load: str, cache: str | None) -> Path | None:
    """Every rank: `fetch` split among the ranks of each node (torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE; without them one node), then a barrier."""
    local_rank, local_size = node_share(dist.get_rank(), dist.get_world_size())
    root = fetch(load, cache, part=local_rank, parts=local_size)
    dist.barrier()
    return root
