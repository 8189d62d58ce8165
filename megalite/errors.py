"""Errors users see (docs/design.md §9).

Each names the thing that is wrong (flag, file, rank, iteration) with the expected and
actual values. Entry points catch `MegaliteError`, print its message and exit non-zero,
so a user never reads a traceback for bad input.
"""


class MegaliteError(Exception):
    """Base of every error caused by user input or user files."""


class ConfigError(MegaliteError):
    """A flag or a combination of flags that cannot work."""


class DataError(MegaliteError):
    """A missing, corrupt or inconsistent data file, or input text that cannot be used."""


class CheckpointError(MegaliteError):
    """A missing, corrupt, incomplete or incompatible checkpoint."""


class NumericalError(MegaliteError):
    """The loss or a gradient became NaN or infinite (outside fp16 loss scaling)."""


class StorageError(MegaliteError):
    """An object store that cannot be reached, refuses a request, or returns other bytes
    than were written."""
