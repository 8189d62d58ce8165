"""Where checkpoint files live and how they become visible (docs/design.md §8).

Layout: `<save>/iter_0000100/` holds one file per shard plus `metadata.json`;
`<save>/latest_checkpointed_iteration.txt` names the checkpoint to resume from. This module
knows nothing of models or optimizers: the caller decides what goes into each file.

A save is made visible in three steps, each of which survives a crash at any point:
  1. rank 0 `prepare_staging`; barrier;
  2. every rank `save_tensor_file` into `staging_dir(save, iteration)`; barrier;
  3. rank 0 `commit` (metadata, rename staging -> `iter_*`, then the tracker), then
     `apply_retention`; barrier, so no rank returns before the checkpoint is durable.
A crash before the tracker is replaced leaves the previous checkpoint as the one loaded.
Loading (`find_checkpoint_to_load`, `read_metadata`, `load_tensor_file`) only reads, so any
rank may call it. No function here communicates; the caller owns the barriers.

What was written is what is read: torch.save writes a CRC-32 of every record of its zip
file, which torch.load never checks (a flipped bit in a tensor loads as another value);
`load_tensor_file` checks them first (`damaged_file`). metadata.json carries a CRC-32 of
its own content.
"""

import json
import pickle
import re
import shutil
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import torch

from megalite.atomic_write import atomic_write, fsync_dir, swap_in
from megalite.errors import CheckpointError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_FILENAME = "metadata.json"
RELEASE = "release"  # Megatron's tracker text for a converted checkpoint in <load>/release


_ITER_DIR = re.compile(r"iter_(\d{7,})")
_LEFTOVER_DIR = re.compile(r"iter_(\d{7,})\.(tmp|old)")


def checkpoint_dir(save: str | Path, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


def staging_dir(save: str | Path, iteration: int) -> Path:
    """Deterministic, so every rank writes its shard there without being told the name."""
    final = checkpoint_dir(save, iteration)
    return final.with_name(final.name + ".tmp")


@contextmanager
def _io_errors(what: str, path: Path) -> Iterator[None]:
    """A full disk or a read-only --save is the user's to fix, not a traceback."""
    try:
        yield
    except OSError as error:
        raise CheckpointError(f"cannot {what} {path}: {error}") from error


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Nothing written half: `path.tmp`, fsync, rename over `path`, fsync the directory."""
    with _io_errors("write", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write, durable=True)


def prepare_staging(save: str | Path, iteration: int) -> Path:
    """Rank 0, before the barrier that precedes every rank's writes: an empty staging dir.

    A staging dir left by a crashed save of the same iteration may hold shards of another
    layout; it is removed so `commit` never mixes them into this checkpoint.
    """
    staging = staging_dir(save, iteration)
    with _io_errors("create staging directory", staging):
        Path(save).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    return staging


def save_tensor_file(obj: Any, path: str | Path) -> None:
    """Any rank: `torch.save` atomically, so a file under its final name is always whole."""
    _atomic_write(Path(path), lambda f: torch.save(obj, f))


def load_tensor_file(path: str | Path, mmap: bool = False) -> Any:
    """A checkpoint file, by `guarded_load` (on the CPU), once its records match their
    CRC-32s (`damaged_file`: one read of the file). With `mmap` tensors are read from disk
    only when touched (resharding reads pieces)."""
    damage = damaged_file(Path(path)) if Path(path).is_file() else None
    if damage is not None:
        raise CheckpointError(f"{damage}: it changed after it was written; restore it, or "
                              f"resume from an older checkpoint (docs/troubleshooting.md)")
    return guarded_load(Path(path), f"checkpoint file {path}", mmap=mmap)


def guarded_load(source: Path | BinaryIO, what: str, allowed: Sequence = (),
                 mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)` onto the CPU of a path or a stream, with the extra globals
    `allowed`: a file holding anything else is refused without running its pickle, so a
    checkpoint cannot run code. `what` names the file in errors."""
    if isinstance(source, Path) and not source.is_file():
        raise CheckpointError(f"{what} does not exist")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        # The line of torch's message that says what was refused, without its advice.
        reason = str(error).split("WeightsUnpickler error:", 1)[-1].strip()
        reason = reason.splitlines()[0].split(". Please", 1)[0] if reason else repr(error)
        raise CheckpointError(f"{what} refused by weights_only loading, nothing in it was run: "
                              f"it is corrupt or holds objects other than tensors and plain "
                              f"containers ({reason})") from error
    except Exception as error:
        raise CheckpointError(f"{what} is unreadable (corrupt or not written by torch.save): "
                              f"{error!r}") from error


def _missing_files(files: Any, where: str, directory: Path) -> list[str]:
    """Those of `files` not in `directory`. Listed names must stay inside it, so
    `directory / name` never escapes it."""
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        raise CheckpointError(f"{where}: 'files' must be a list of file names, got {files!r}")
    escaping = [f for f in files if Path(f).is_absolute() or ".." in Path(f).parts]
    if escaping:
        raise CheckpointError(f"{where}: file names must be relative to the checkpoint "
                              f"directory, got {escaping}")
    return [f for f in files if not (directory / f).is_file()]


def commit(save: str | Path, iteration: int, metadata: dict,
           expected_files: list[str], track: bool = True) -> Path:
    """Rank 0, after the barrier that follows every rank's writes: publish the checkpoint.

    Order matters: metadata last inside staging (a dir with metadata is complete), then the
    rename, then the tracker (unless not `track`: it names a newer checkpoint, which
    save_guard.newer_tracked keeps it from moving back past). A checkpoint of the same
    iteration from an earlier run (resumed from an older one) is moved aside and deleted
    only once the new one is in place.
    """
    save, staging, final = Path(save), staging_dir(save, iteration), checkpoint_dir(save, iteration)
    aside = final.with_name(final.name + ".old")
    if not staging.is_dir():
        raise CheckpointError(f"staging directory {staging} does not exist (no prepare_staging)")
    missing = _missing_files(expected_files, f"checkpoint {final}", staging)
    if missing:
        raise CheckpointError(f"cannot commit checkpoint {final}: {len(missing)} of "
                              f"{len(expected_files)} files missing from {staging}: {missing}")
    text = metadata_bytes(metadata, iteration, expected_files)
    _atomic_write(staging / METADATA_FILENAME, lambda f: f.write(text))
    with _io_errors("publish checkpoint", final):
        swap_in(staging, final, aside)
        fsync_dir(save)
    if track:
        _atomic_write(save / TRACKER_FILENAME, lambda f: f.write(str(iteration).encode()))
    shutil.rmtree(aside, ignore_errors=True)
    return final


def metadata_bytes(metadata: dict, iteration: int, files: list[str]) -> bytes:
    """metadata.json's content: `metadata` with the iteration, the files and a checksum."""
    record = {**metadata, "iteration": iteration, "files": list(files)}
    record["checksum"] = _checksum(record)  # a non-JSON value fails here
    return json.dumps(record, indent=2, sort_keys=True).encode()


def read_metadata(directory: str | Path) -> dict:
    """The metadata of a complete checkpoint; anything less is an error naming the path."""
    directory = Path(directory)
    path = directory / METADATA_FILENAME
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not path.is_file():
        raise CheckpointError(f"incomplete checkpoint {directory}: no {METADATA_FILENAME} "
                              f"(the save did not finish); it is never loaded")
    try:
        text = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable: {error}") from error
    record = parse_metadata(text, path)
    missing = _missing_files(record.get("files"), f"checkpoint metadata {path}", directory)
    if missing:
        raise CheckpointError(f"incomplete checkpoint {directory}: {len(missing)} of "
                              f"{len(record['files'])} listed files missing: {missing}")
    return record


def parse_metadata(text: bytes, path: str | Path) -> dict:
    """metadata.json's record (`path` names it in errors), checked against its checksum."""
    try:
        record = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable or not valid JSON: "
                              f"{error}") from error
    if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
        raise CheckpointError(f"checkpoint metadata {path} is garbled: expected a JSON object "
                              f"with an integer 'iteration' and a 'files' list")
    checksum = record.pop("checksum", None)  # metadata written before checksums has none
    if checksum is not None and checksum != _checksum(record):
        raise CheckpointError(f"checkpoint metadata {path} does not match its checksum: it "
                              f"changed after it was written (storage corruption?)")
    if isinstance(record.get("model"), dict):  # JSON made GPTConfig's tuples lists
        record["model"] = {k: tuple(v) if isinstance(v, list) else v
                           for k, v in record["model"].items()}
    return record


def _checksum(record: dict) -> str:
    """Of the metadata as parsed, so it reads the same whatever the file's layout."""
    return f"crc32:{zlib.crc32(json.dumps(record, sort_keys=True).encode()):08x}"


def damaged_file(path: Path) -> str | None:
    """Why checkpoint file `path` is not what torch.save wrote (a record whose bytes do not
    match its CRC-32, or no zip at all), or None. Reads the whole file."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as error:  # BadZipFile, a truncated read, an I/O error
        return f"checkpoint file {path} is unreadable: {error!r}"
    if bad is not None:
        return (f"checkpoint file {path} is corrupt: its record {bad} does not match the "
                f"CRC-32 torch.save wrote")
    return None


def _read_tracker(save: Path) -> int | str:
    """The tracker's iteration, or RELEASE; an error naming the tracker if garbled."""
    tracker = save / TRACKER_FILENAME
    try:
        text = tracker.read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint tracker {tracker} is unreadable: {error}") from error
    return parse_tracker(text, tracker)


def parse_tracker(data: bytes, tracker: str | Path) -> int | str:
    """The tracker's iteration or RELEASE from its bytes; `tracker` names it in errors."""
    try:
        text = data.decode().strip()
    except UnicodeDecodeError as error:
        raise CheckpointError(f"checkpoint tracker {tracker} is unreadable: {error}") from error
    if not text:
        raise CheckpointError(f"checkpoint tracker {tracker} is empty; expected an iteration")
    if text == RELEASE:
        return RELEASE
    if not re.fullmatch(r"\d+", text):
        raise CheckpointError(f"checkpoint tracker {tracker} is garbled: expected an iteration "
                              f"number or '{RELEASE}', found {text[:50]!r}")
    return int(text)


def tracked_checkpoint(save: Path) -> tuple[int, Path]:
    """(iteration, directory) the tracker in `save` names; `release` is iteration 0."""
    iteration = _read_tracker(save)
    if iteration == RELEASE:
        return 0, save / RELEASE
    return iteration, checkpoint_dir(save, iteration)


def _complete_metadata(directory: Path) -> dict | None:
    try:
        return read_metadata(directory)
    except CheckpointError:
        return None


def iteration_dirs(save: Path) -> dict[int, Path]:
    """The `iter_*` directories in `save`, complete or not, by iteration."""
    return {int(m.group(1)): d for d in save.iterdir()
            if (m := _ITER_DIR.fullmatch(d.name)) and d.is_dir()}


def checkpoint_names(directory: Path) -> list[str]:
    """The checkpoint directories in `directory`, complete or not, by name (staging and
    moved-aside leftovers of a crashed save are not checkpoints)."""
    return sorted(d.name for d in iteration_dirs(directory).values()) + (
        [RELEASE] if (directory / RELEASE).is_dir() else [])


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested record's leaves by key path ("model_tp00_pp000.pt/model/0/weight")."""
    if not isinstance(value, (dict, list, tuple)):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return {k: v for key, item in items for k, v in flatten(item, f"{prefix}/{key}").items()}


def checkpoint_values(directory: Path) -> dict[str, Any]:
    """Every value of every .pt file of a checkpoint directory, by file and key path: what
    two runs' checkpoints are compared by."""
    return {k: v for path in sorted(Path(directory).glob("*.pt"))
            for k, v in flatten(load_tensor_file(path), path.name).items()}


def find_checkpoint_to_load(load: str | Path) -> tuple[int, Path] | None:
    """The (iteration, directory) the tracker names, checked complete; None on a fresh start.

    Fresh start: `load` does not exist, or holds neither a tracker nor a checkpoint dir (a
    leftover staging dir from a crash during the very first save does not count).
    """
    load = Path(load)
    if not load.exists():
        return None
    if not load.is_dir():
        raise CheckpointError(f"checkpoint path {load} is not a directory")
    tracker = load / TRACKER_FILENAME
    if not tracker.exists():
        dirs = iteration_dirs(load)
        found = checkpoint_names(load)
        if not found:
            return None
        # The first save of a run stopped between publishing its directory and writing the
        # tracker (commit's last step) leaves one whole checkpoint and no tracker: the only
        # one there is to resume from. Several are the user's to choose between.
        if len(found) == 1 and dirs and _complete_metadata(next(iter(dirs.values()))):
            return _checked_iteration(*next(iter(dirs.items())))
        raise CheckpointError(
            f"checkpoint tracker {tracker} is missing but {load} holds "
            f"checkpoint directories {found}; write the iteration to resume from into it, "
            f"or point --load elsewhere")
    iteration, directory = tracked_checkpoint(load)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint tracker {tracker} names iteration {iteration}, but "
                              f"{directory} does not exist; write the iteration of a "
                              f"checkpoint {load} holds into it")
    return _checked_iteration(iteration, directory)


def _checked_iteration(iteration: int, directory: Path) -> tuple[int, Path]:
    record = read_metadata(directory)
    # A release checkpoint's metadata has no iteration to check: Megatron's is 0.
    if directory.name != RELEASE and record["iteration"] != iteration:
        raise CheckpointError(f"checkpoint {directory} records iteration {record['iteration']}, "
                              f"but its name and the tracker say {iteration}")
    return iteration, directory


def apply_retention(save: str | Path, keep: int,
                    owns: Callable[[int, dict], bool] | None = None) -> list[Path]:
    """Rank 0, after `commit`: delete all but the newest `keep` complete checkpoints of
    those `owns(iteration, metadata)` says are the saving run's (save_guard.RunRecord; None:
    all): another run's are neither counted nor deleted.

    The one the tracker names is never deleted, even if older (a run resumed from it).
    Incomplete `iter_*` dirs are not ours to judge and are left alone. Staging (`.tmp`) and
    moved-aside (`.old`) dirs up to the tracker's iteration are leftovers of crashed saves.
    keep <= 0 keeps every checkpoint. Returns the deleted paths, for the log.
    """
    save = Path(save)
    tracked = _read_tracker(save)
    dirs = iteration_dirs(save)
    complete = {i: meta for i, d in dirs.items() if (meta := _complete_metadata(d)) is not None}
    deleted = [dirs[i] for i in retired(complete, tracked, keep, owns)]
    if tracked != RELEASE:
        deleted += [d for d in save.iterdir() if d.is_dir() and
                    (m := _LEFTOVER_DIR.fullmatch(d.name)) and int(m.group(1)) <= tracked]
    for d in deleted:
        shutil.rmtree(d, ignore_errors=True)
    return deleted


def retired(complete: dict[int, dict], tracked: int | str, keep: int,
            owns: Callable[[int, dict], bool] | None) -> list[int]:
    """Of the complete checkpoints (iteration -> metadata), those apply_retention deletes:
    the run's (`owns`) but its newest `keep` and the tracked one; none when keep <= 0."""
    if keep <= 0:
        return []
    ours = [i for i in sorted(complete) if owns is None or owns(i, complete[i])]
    kept = set(ours[-keep:]) | {tracked}
    return [i for i in ours if i not in kept]
