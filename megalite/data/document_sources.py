"""The documents `tools/preprocess_data.py` reads, as one stream in input order.

`--input` is a file, a directory or a glob. `resolve_inputs` expands it into `Source`s,
one per file, sorted by path (a HuggingFace `datasets` directory written by `save_to_disk`
contributes its Arrow files in the order its `state.json` lists them, the dataset's order):

    format     files                                  read with
    jsonl      .jsonl/.json, .gz, .zst/.zstd          the worker parses each line
    parquet    .parquet                               pyarrow, row batches (extra: parquet)
    arrow      .arrow, or a save_to_disk directory    pyarrow IPC stream reader (extra: parquet)

`read_records(source, keys, batch_rows)` yields `(n, nbytes, payload)` for rows n = 1, 2, ...
of one file: a JSONL line as bytes (parsed by the worker, so bad JSON is reported by line),
or a columnar row as a dict of the `keys` columns. Nothing reads a whole file: JSONL is read
line by line through the decompressor, Parquet one batch of `batch_rows` rows at a time
(buffered page reads, no pre-buffering of whole row groups), Arrow one record batch as the
writer stored it (1,000 rows for `datasets`) sliced into `batch_rows`.

A file that cannot be read on (missing, not Parquet, a corrupt page, a truncated gzip or
zstd stream, a column that is not there) raises `ShardError` naming the file and the first
row it could not give; the rows before it were yielded.
"""

import dataclasses
import glob
import importlib
import io
import json
import os
import zlib

from megalite.errors import ConfigError, DataError

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")
# Suffix -> format, the longer suffixes first (".jsonl.gz" before ".jsonl").
_SUFFIXES = {".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz", ".jsonl.zst": "jsonl.zst",
             ".json.zst": "jsonl.zst", ".jsonl.zstd": "jsonl.zst", ".json.zstd": "jsonl.zst",
             ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_EXTRA_OF = {"pyarrow": "parquet", "zstandard": "zstd"}


class ShardError(DataError):
    """A file that cannot be read from row (JSONL: line) `row` on."""

    def __init__(self, source, row, reason):
        super().__init__(f"{source.where(row)}: {reason}")
        self.path, self.row, self.reason = source.path, row, reason


def optional_import(module, needed_for):
    """Import an optional dependency, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise ConfigError(f"{needed_for} needs {top}, which is not installed: "
                          f"pip install -e .[{_EXTRA_OF[top]}]  (or pip install {top})") from None


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    format: str  # one of FORMATS

    @property
    def stem(self):
        """The file name without its format suffix (names per-input outputs)."""
        name = os.path.basename(self.path)
        suffix = _suffix_of(name)
        return name[:-len(suffix)] if suffix else os.path.splitext(name)[0]

    def where(self, row):
        """`file:line` for JSONL (as compilers and Megatron's users read it), else `file: row n`."""
        if self.format.startswith("jsonl"):
            return f"{self.path}:{row}"
        return f"{self.path}: row {row}"


# ---- --input -> Sources ----

def _suffix_of(path):
    """The format suffix a file's name ends with, or None."""
    return next((suffix for suffix in _SUFFIXES if path.endswith(suffix)), None)


def format_of(path):
    """The format a file's name says, or None."""
    return _SUFFIXES.get(_suffix_of(path))


def resolve_inputs(spec, input_format=None):
    """Sources for a file, a directory or a glob, in sorted path order."""
    if os.path.isfile(spec):
        # One named file: JSONL unless its name says otherwise (what --input always took).
        fmt = input_format or format_of(spec) or ("jsonl.gz" if spec.endswith(".gz") else "jsonl")
        return [Source(spec, fmt)]
    if os.path.isdir(spec):
        sources = _directory(spec, input_format)
    else:
        matches = sorted(glob.glob(spec, recursive=True))
        if not matches:
            raise DataError(f"--input {spec}: file not found (no file, directory or glob match)")
        sources = [s for m in matches for s in resolve_inputs(m, input_format)]
    if not sources:
        raise DataError(f"--input {spec}: no input files (expected names ending in "
                        f"{', '.join(_SUFFIXES)}, or --input-format)")
    return sources


def _directory(path, input_format):
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise DataError(f"--input {path}: a datasets DatasetDict; give one split's directory "
                        f"({', '.join(os.path.join(path, s) for s in splits)})")
    if os.path.isfile(os.path.join(path, "state.json")):
        return _saved_dataset(path)
    files = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(folder, n) for n in names if not n.startswith(".")]
    if input_format:
        return [Source(p, input_format) for p in sorted(files)]
    return [Source(p, format_of(p)) for p in sorted(files) if format_of(p)]


def _saved_dataset(path):
    """The Arrow files of a `Dataset.save_to_disk` directory, in the dataset's order."""
    state_path = os.path.join(path, "state.json")
    try:
        with open(state_path) as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state_path}: expected a datasets save_to_disk state with "
                        f"_data_files, got an unreadable file ({e})") from None
    return [Source(os.path.join(path, name), "arrow") for name in files]


_MODULES_OF = {"jsonl.zst": ("zstandard",), "parquet": ("pyarrow", "pyarrow.parquet"),
               "arrow": ("pyarrow",)}


def check_dependencies(sources):
    """Fail before any work when a format's optional dependency is missing."""
    for fmt in sorted({source.format for source in sources}):
        first = next(source.path for source in sources if source.format == fmt)
        for module in _MODULES_OF.get(fmt, ()):
            optional_import(module, f"{first} ({fmt})")


# ---- one Source -> (row, bytes, payload) records ----

def read_records(source, keys, batch_rows):
    if source.format.startswith("jsonl"):
        return _jsonl_records(source)
    if source.format == "parquet":
        return _parquet_records(source, keys, batch_rows)
    return _arrow_records(source, keys, batch_rows)


def _jsonl_records(source):
    n = 0
    try:
        with open_jsonl(source) as f:
            for n, line in enumerate(f, start=1):
                yield n, len(line), line
    except (OSError, EOFError, zlib.error) as e:
        raise ShardError(source, n + 1, f"cannot read on: {e}") from None
    except Exception as e:  # zstandard.ZstdError, whose module may not be imported
        if type(e).__name__ != "ZstdError":
            raise
        raise ShardError(source, n + 1, f"cannot read on: zstd: {e}") from None


def open_jsonl(source):
    """A JSONL source as a binary file object, decompressed as its format says."""
    if source.format == "jsonl.gz":
        import gzip
        return gzip.open(source.path, "rb")
    if source.format == "jsonl.zst":
        zstd = optional_import("zstandard", f"{source.path} (zstd-compressed JSONL)")
        return io.BufferedReader(_ZstdReader(open(source.path, "rb"), zstd), 1 << 20)
    return open(source.path, "rb")


class _ZstdReader(io.RawIOBase):
    """Decompresses every frame of a .zst file in turn; a file that ends inside a frame
    raises EOFError (zstandard's own stream reader returns the partial data silently)."""

    def __init__(self, file, zstd):
        self._file, self._zstd, self._pending = file, zstd, b""
        self._frame = None  # the decompressor of the frame being read, None between frames

    def readable(self):
        return True

    def readinto(self, buffer):
        while not self._pending:
            data = self._file.read(1 << 20)
            if not data:
                if self._frame is not None:
                    raise EOFError("zstd stream ended inside a frame (truncated file?)")
                return 0
            self._decompress(data)
        size = min(len(buffer), len(self._pending))
        buffer[:size], self._pending = self._pending[:size], self._pending[size:]
        return size

    def _decompress(self, data):
        while data:
            if self._frame is None:
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
            self._pending += self._frame.decompress(data)
            if not self._frame.eof:
                return
            data, self._frame = self._frame.unused_data, None

    def close(self):
        self._file.close()
        super().close()


def _parquet_records(source, keys, batch_rows):
    pa = optional_import("pyarrow", f"{source.path} (Parquet)")
    pq = optional_import("pyarrow.parquet", f"{source.path} (Parquet)")
    try:
        # Checksums verified where the writer stored them: a flipped bit in a page is named.
        parquet = pq.ParquetFile(source.path, buffer_size=1 << 20, pre_buffer=False,
                                 page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise ShardError(source, 1, f"not a readable Parquet file: {e}") from None
    _check_columns(source, parquet.schema_arrow.names, keys)
    return _rows(source, pa, parquet.iter_batches(batch_size=batch_rows, columns=keys))


def _arrow_records(source, keys, batch_rows):
    pa = optional_import("pyarrow", f"{source.path} (Arrow)")
    schema, batches = _arrow_batches(source, pa)
    _check_columns(source, schema.names, keys)
    parts = (part.select(keys) for batch in batches
             for part in (batch.slice(i, batch_rows) for i in range(0, batch.num_rows,
                                                                    batch_rows)))
    return _rows(source, pa, parts)


def _arrow_batches(source, pa):
    """(schema, record batches) of an Arrow IPC stream (what `datasets` writes) or, failing
    that, an Arrow IPC file (random access, read one batch at a time)."""
    try:
        stream = pa.ipc.open_stream(pa.OSFile(source.path, "rb"))
        return stream.schema, stream
    except (OSError, pa.ArrowException):
        pass
    try:
        reader = pa.ipc.open_file(pa.OSFile(source.path, "rb"))
    except (OSError, pa.ArrowException) as e:
        raise ShardError(source, 1, f"not a readable Arrow IPC stream or file: {e}") from None
    return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def _check_columns(source, names, keys):
    missing = [key for key in keys if key not in names]
    if missing:
        raise ShardError(source, 1, f"no column {missing[0]!r} for --json-keys "
                         f"(columns: {', '.join(names)})")


def _rows(source, pa, batches):
    n = 0
    try:
        for batch in batches:
            rows = batch.to_pylist()
            for i, row in enumerate(rows):
                # the batch's bytes counted once, for the MB/s figure
                yield n + i + 1, batch.nbytes if i == 0 else 0, row
            n += len(rows)
    except (OSError, pa.ArrowException) as e:
        raise ShardError(source, n + 1, f"cannot read on: {e}") from None
