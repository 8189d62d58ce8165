"""Paths that name object storage (`s3://bucket/key`) rather than a file system.

A leaf: which schemes megalite reads and writes, and the refusal of the others by name, so
that `--save gs://b/run` is never taken for a local directory `gs:/b/run` (what pathlib
makes of it)."""

import re

from megalite.errors import ConfigError

SUPPORTED_SCHEMES: tuple[str, ...] = ()
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
