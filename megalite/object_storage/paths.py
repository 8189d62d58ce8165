"""Paths that name object storage (`s3://bucket/key`) rather than a file system.

A leaf: which schemes megalite reads and writes, and the refusal of the others by name, so
that `--save gs://b/run` is never taken for a local directory `gs:/b/run` (what pathlib
makes of it)."""

import os
import re
import tempfile
from pathlib import Path

from megalite.errors import ConfigError

SUPPORTED_SCHEMES: tuple[str, ...] = ("s3",)
"""The URL schemes megalite's storage clients speak."""

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(path: str) -> str | None:
    """The scheme of `path` if it is a URL (`s3://...` -> "s3"), else None."""
    match = _SCHEME.match(str(path))
    return match.group(1).lower() if match else None


def check_storage_path(flag: str, path: str | None, local_only: bool = False) -> None:
    """Refuses a URL `path` of `flag` whose scheme megalite does not support (or any URL
    when `local_only`), naming the flag, the scheme and what is supported."""
    scheme = None if path is None else url_scheme(path)
    if scheme is None or (scheme in SUPPORTED_SCHEMES and not local_only):
        return
    supported = () if local_only else SUPPORTED_SCHEMES
    accepted = "a local path" + "".join(f" or {s}://bucket/prefix" for s in supported)
    raise ConfigError(f"{flag} {path}: {scheme}:// is not supported here (expected {accepted}); "
                      f"it is not taken as a local path")


def is_object_url(path) -> bool:
    """Whether `path` names objects in a store megalite speaks, not a local path."""
    return url_scheme(str(path)) in SUPPORTED_SCHEMES


def cache_root(cache_path: str | None) -> Path:
    """The node-local directory object-storage reads and writes pass through
    (--object-storage-cache-path; default: under the system's temporary directory, one for
    every process of the node)."""
    return Path(cache_path) if cache_path else Path(tempfile.gettempdir()) / "megalite-objects"


def mirror_path(url: str, cache_path: str | None) -> Path:
    """Where `url`'s objects are staged and cached on this node: the cache, then the
    scheme, bucket and key as directories."""
    scheme, rest = str(url).split("://", 1)
    return cache_root(cache_path) / scheme / rest.strip("/")


def node_share(rank: int, world_size: int) -> tuple[int, int]:
    """(this process's place among its node's processes, how many there are): torchrun's
    LOCAL_RANK and LOCAL_WORLD_SIZE; without them, one node of `world_size`. How a node's
    processes split the downloads into its cache."""
    return (int(os.environ.get("LOCAL_RANK", rank)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
