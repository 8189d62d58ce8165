"""Megatron-compatible indexed dataset: a `.bin` of token ids and an `.idx` that locates them.

Byte layout (docs/design.md §7), identical to Megatron-LM's `MMapIndexedDataset`:

    .bin  token ids of every sequence back to back, no header
    .idx  little-endian:
          9-byte magic b"MMIDIDX\\x00\\x00", u64 version (1), u8 dtype code,
          u64 N (sequences), u64 D (document-index entries = documents + 1),
          int32[N] sequence lengths in tokens, int64[N] byte offsets into .bin,
          int64[D] document boundaries as sequence indices (first 0, last N)

A document is one or more sequences; an empty document has no sequence but still gets a
boundary, so the document index repeats a value (this is what Megatron's tool writes).

`IndexedDatasetBuilder` writes a pair, `IndexedDataset` maps one read-only and checks that
the two files agree before anything is read from them.
"""

import mmap
import os
import shutil
import struct
from array import array

import numpy as np

from megalite.atomic_write import atomic_path
from megalite.errors import DataError

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D: 34 bytes
_CHECK_BLOCK = 1 << 20  # sequences validated per step, so opening never copies the index


def best_dtype(vocab_size):
    """The narrowest dtype Megatron uses for a vocabulary: uint16 below 65500, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def _token_limits(dtype, vocab_size):
    """[low, high) of the ids a builder accepts: the vocabulary, within what dtype can hold."""
    if np.dtype(dtype).kind == "f":
        return None
    info = np.iinfo(dtype)
    if vocab_size is None:
        return int(info.min), int(info.max) + 1
    if vocab_size > int(info.max) + 1:
        raise DataError(f"vocab size {vocab_size} does not fit dtype {np.dtype(dtype)} "
                        f"(max id {info.max})")
    return 0, int(vocab_size)


class IndexedDatasetBuilder:
    """Streams documents into `bin_path`; `finalize(idx_path)` writes the index.

    Tokens go straight to disk; memory holds only the index (4 bytes per sequence and
    8 per document) until `finalize`. Both files are written under `<name>.tmp` and
    renamed by `finalize`, .bin first, so an interrupted run never leaves a pair that
    looks complete. Used as a context manager, an exception discards the temp files.
    """

    def __init__(self, bin_path, dtype, vocab_size=None):
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise DataError(f"unsupported token dtype {self.dtype}: expected one of "
                            f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.vocab_size = vocab_size
        self._limits = _token_limits(self.dtype, vocab_size)
        self._tmp_bin = self.bin_path + ".tmp"
        self._bin = open(self._tmp_bin, "wb", buffering=1 << 20)
        self._lengths = array("i")  # int32, like the .idx
        self._doc_idx = array("q", [0])  # int64

    @property
    def num_documents(self):
        return len(self._doc_idx) - 1

    def add_sequence(self, tokens):
        """Append one sequence to the current document (an empty one adds nothing)."""
        tokens = self._checked(tokens)
        if tokens.size:
            self._write(tokens, [tokens.size])

    def end_document(self):
        """Close the current document: record a boundary after the last sequence."""
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens, lengths=None):
        """Append a whole document: one sequence, or one per entry of `lengths`.

        Like Megatron's builder, an empty document adds no sequence but still records a
        boundary. The whole document is range-checked before any byte is written.
        """
        tokens = self._checked(tokens)
        lengths = [tokens.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != tokens.size or min(lengths, default=1) < 0:
            raise DataError(f"{self.bin_path}: document {self.num_documents} has "
                            f"{tokens.size} tokens but sequence lengths {lengths}")
        self._write(tokens, [n for n in lengths if n])
        self.end_document()

    def add_index(self, path_prefix):
        """Append every document of the dataset at `path_prefix` (same dtype), in order."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{path_prefix}.idx: dtype expected {self.dtype}, got {other.dtype}")
        offset = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.tobytes())
        self._doc_idx.frombytes((other.document_indices[1:] + offset).tobytes())
        with open(path_prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 20)

    def finalize(self, idx_path):
        """Write the index next to the tokens and move both to their final names."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with atomic_path(idx_path) as tmp_idx:
            with open(tmp_idx, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, _CODE_OF[self.dtype], len(lengths),
                                     len(self._doc_idx)))
                f.write(lengths.tobytes())
                f.write(pointers.tobytes())
                f.write(np.frombuffer(self._doc_idx, dtype=np.int64).tobytes())
            # The tokens first: an index under its final name always has its .bin.
            os.replace(self._tmp_bin, self.bin_path)

    def discard(self):
        """Abandon the output: close and delete the temp file."""
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.discard()

    def _checked(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.size == 0 or self._limits is None:
            return tokens.reshape(-1)
        if tokens.dtype.kind not in "iu":
            raise DataError(f"{self.bin_path}: document {self.num_documents} holds "
                            f"{tokens.dtype} values, expected integer token ids")
        low, high = self._limits
        bad = (tokens < low) | (tokens >= high)
        if bad.any():
            raise DataError(
                f"{self.bin_path}: token id {int(tokens[bad][0])} in document "
                f"{self.num_documents} is outside [{low}, {high})"
                + (f" (vocab size {self.vocab_size})" if self.vocab_size is not None else
                   f" (dtype {self.dtype})"))
        return tokens.reshape(-1)

    def _write(self, tokens, lengths):
        # Checked above, so narrowing to the dtype cannot wrap around.
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths)


class IndexedDataset:
    """Read-only memory map of `<path_prefix>.bin/.idx`, validated on open.

    `len(ds)` is the number of sequences; `ds[i]` / `ds.get(i, offset, length)` return
    views of the tokens (no copy). Every inconsistency raises `DataError` naming the file
    and the expected and actual values.
    """

    def __init__(self, path_prefix):
        self.path_prefix = str(path_prefix)
        self.idx_path = self.path_prefix + ".idx"
        self.bin_path = self.path_prefix + ".bin"
        idx = _map(self.idx_path, what="index")
        code, num_seqs, num_docs = _read_header(self.idx_path, idx)
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_lengths = np.frombuffer(idx, np.int32, num_seqs, _HEADER.size)
        self.sequence_pointers = np.frombuffer(idx, np.int64, num_seqs,
                                               _HEADER.size + 4 * num_seqs)
        self.document_indices = np.frombuffer(idx, np.int64, num_docs,
                                              _HEADER.size + 12 * num_seqs)
        _check_documents(self.idx_path, self.document_indices, num_seqs)
        bin_bytes = _check_pointers(self.idx_path, self.sequence_lengths,
                                    self.sequence_pointers, self.dtype.itemsize)
        # Every token of the file, back to back (a read-only view of the mmap).
        self.tokens = np.frombuffer(_map(self.bin_path, "data", bin_bytes, self.idx_path),
                                    self.dtype)

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, idx, offset=0, length=None):
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end by default)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"{self.path_prefix}: sequence {idx} out of range [0, {len(self)})")
        idx %= len(self)
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.path_prefix}: tokens [{offset}, {offset + length}) "
                             f"outside sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def __getstate__(self):
        # mmaps cannot be pickled (DataLoader workers): reopen from the path instead.
        return self.path_prefix

    def __setstate__(self, path_prefix):
        self.__init__(path_prefix)


def _map(path, what, expected_size=None, described_by=None):
    """mmap `path` read-only; check its size first when the index says what it must be."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: {what} file not found")
    size = os.path.getsize(path)
    if expected_size is not None and size != expected_size:
        raise DataError(f"{path}: size expected {expected_size} bytes (from {described_by}), "
                        f"got {size}")
    if size == 0:
        return b""  # mmap refuses empty files; an empty .bin is a valid empty dataset
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_header(path, idx):
    if len(idx) < _HEADER.size:
        raise DataError(f"{path}: truncated header: expected at least {_HEADER.size} bytes, "
                        f"got {len(idx)}")
    magic, version, code, num_seqs, num_docs = _HEADER.unpack_from(idx)
    if magic != _MAGIC:
        raise DataError(f"{path}: bad magic: expected {_MAGIC!r}, got {magic!r} "
                        "(not a Megatron indexed-dataset index)")
    if version != _VERSION:
        raise DataError(f"{path}: version expected {_VERSION}, got {version}")
    if code not in DTYPE_CODES:
        raise DataError(f"{path}: dtype code expected one of {sorted(DTYPE_CODES)}, got {code}")
    expected = _HEADER.size + 12 * num_seqs + 8 * num_docs
    if len(idx) != expected:
        raise DataError(f"{path}: size expected {expected} bytes for {num_seqs} sequences and "
                        f"{num_docs} document-index entries, got {len(idx)}")
    return code, num_seqs, num_docs


def _check_documents(path, doc_idx, num_seqs):
    if len(doc_idx) == 0 or doc_idx[0] != 0:
        first = doc_idx[0] if len(doc_idx) else "nothing"
        raise DataError(f"{path}: document index must start with 0, got {first}")
    if doc_idx[-1] != num_seqs:
        raise DataError(f"{path}: document index must end with the sequence count "
                        f"{num_seqs}, got {doc_idx[-1]}")
    for start in range(0, len(doc_idx) - 1, _CHECK_BLOCK):
        block = doc_idx[start:start + _CHECK_BLOCK + 1]
        drops = np.flatnonzero(np.diff(block) < 0)
        if drops.size:
            i = start + int(drops[0])
            raise DataError(f"{path}: document index decreases at entry {i + 1}: "
                            f"expected >= {doc_idx[i]}, got {doc_idx[i + 1]}")


def _check_pointers(path, lengths, pointers, itemsize):
    """Each offset must be the previous one plus that sequence's bytes; return .bin size."""
    end = 0
    for start in range(0, len(lengths), _CHECK_BLOCK):
        block = lengths[start:start + _CHECK_BLOCK].astype(np.int64)
        if (block < 0).any():
            i = start + int(np.flatnonzero(block < 0)[0])
            raise DataError(f"{path}: length of sequence {i} expected >= 0, got {lengths[i]}")
        sizes = block * itemsize
        expected = end + np.cumsum(sizes) - sizes
        wrong = np.flatnonzero(expected != pointers[start:start + len(block)])
        if wrong.size:
            i = int(wrong[0])
            raise DataError(f"{path}: byte offset of sequence {start + i} expected "
                            f"{expected[i]} (previous offset + length), got {pointers[start + i]}")
        end += int(sizes.sum())
    return end
