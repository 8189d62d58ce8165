"""Publishing a file or a directory whole: written under a temporary name beside its final
one, then renamed over it, so a reader or a crash finds the old or the new, never half.
A leaf: imports nothing of megalite."""

import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


@contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """The temporary name to write `path` under (its name + `suffix`, beside it), renamed
    over `path` when the block ends and removed if it raises."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], suffix: str = ".tmp",
                 durable: bool = False) -> None:
    """`write(f)` into atomic_path's temporary file. `durable`: the file is fsynced before
    the rename and its directory after, so both survive a power cut."""
    with atomic_path(path, suffix) as tmp, open(tmp, "wb") as f:
        write(f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        fsync_dir(Path(path).parent)


def fsync_dir(path: Path) -> None:
    """Makes renames and new entries in `path` durable, not just the files' bytes."""
    # Some filesystems refuse fsync on a directory; the rename is still atomic.
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def swap_in(staging: Path, path: Path, aside: Path) -> None:
    """Renames the complete directory `staging` to `path`. A directory already at `path` is
    first renamed to `aside`, for the caller to delete once it is no longer needed."""
    if path.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
    os.rename(staging, path)


@contextmanager
def staged_directory(path: Path) -> Iterator[Path]:
    """A fresh hidden sibling of `path`, named by process, to fill; swapped in for `path`
    when the block ends. Neither it nor the directory it replaces is left behind."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        swap_in(staging, path, aside)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)


def unwritable_directory(path: str | Path) -> str | None:
    """Why `path` cannot be a directory this process writes into, or None when it can. A
    missing `path` is created (what its first write would do), and a file is created in it
    and removed: permissions and read-only mounts fail here, not after hours of work."""
    path = Path(path)
    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        return f"{file} is a file, not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"cannot create or write a file in it ({error.strerror or error})"
    return None
