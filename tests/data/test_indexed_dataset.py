"""Indexed dataset writer and reader against the .idx/.bin bytes of docs/design.md §7, written
by hand."""

import os
import pickle
import re
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
)
from megalite.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"


def idx_bytes(code, lengths, pointers, docs, magic=MAGIC, version=1):
    """An .idx file written out field by field from the format description."""
    return (magic + struct.pack("<Q", version) + struct.pack("<B", code)
            + struct.pack("<QQ", len(lengths), len(docs))
            + struct.pack(f"<{len(lengths)}i", *lengths)
            + struct.pack(f"<{len(pointers)}q", *pointers)
            + struct.pack(f"<{len(docs)}q", *docs))


# The worked example: vocab 50257, documents [1,2,3] and [4,5 | 6,7,8].
EXAMPLE_IDX = idx_bytes(8, [3, 2, 3], [0, 6, 10], [0, 1, 3])
EXAMPLE_BIN = struct.pack("<8H", 1, 2, 3, 4, 5, 6, 7, 8)


def write_example(prefix):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", best_dtype(50257), vocab_size=50257)
    builder.add_document([1, 2, 3])
    builder.add_sequence([4, 5])
    builder.add_sequence([6, 7, 8])
    builder.end_document()
    builder.finalize(f"{prefix}.idx")


def write_files(prefix, idx, bin_):
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(bin_)


def test_worked_example_bytes(tmp_path):
    write_example(tmp_path / "ex")
    idx = (tmp_path / "ex.idx").read_bytes()
    assert len(idx) == 94
    assert idx == EXAMPLE_IDX
    assert (tmp_path / "ex.bin").read_bytes() == EXAMPLE_BIN


def test_reader_on_hand_written_example(tmp_path):
    write_files(tmp_path / "ex", EXAMPLE_IDX, EXAMPLE_BIN)
    ds = IndexedDataset(str(tmp_path / "ex"))
    assert len(ds) == 3 and ds.dtype == np.uint16
    assert ds.sequence_lengths.dtype == np.int32 and ds.sequence_lengths.tolist() == [3, 2, 3]
    assert ds.sequence_pointers.dtype == np.int64 and ds.sequence_pointers.tolist() == [0, 6, 10]
    assert ds.document_indices.dtype == np.int64 and ds.document_indices.tolist() == [0, 1, 3]
    assert [s.tolist() for s in ds[:]] == [[1, 2, 3], [4, 5], [6, 7, 8]]
    assert ds.get(2, offset=1).tolist() == [7, 8]
    assert ds.get(0, offset=1, length=1).tolist() == [2]
    assert ds[-1].tolist() == [6, 7, 8]
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(IndexError):
        ds.get(1, offset=1, length=2)


def test_dtype_codes_and_best_dtype():
    assert {c: np.dtype(d).name for c, d in DTYPE_CODES.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
        7: "float32", 8: "uint16"}
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32


def test_round_trip_with_empty_documents(tmp_path):
    rng = np.random.default_rng(0)
    documents = []
    for _ in range(50):  # each document: 0..3 sequences of 1..20 ids
        documents.append([rng.integers(0, 100_000, rng.integers(1, 20)).tolist()
                          for _ in range(rng.integers(0, 4))])
    builder = IndexedDatasetBuilder(tmp_path / "rt.bin", best_dtype(100_000), 100_000)
    for doc in documents:
        for seq in doc:
            builder.add_sequence(seq)
        builder.end_document()
    builder.finalize(tmp_path / "rt.idx")

    ds = IndexedDataset(tmp_path / "rt")
    sequences = [seq for doc in documents for seq in doc]
    assert ds.dtype == np.int32 and len(ds) == len(sequences)
    assert [ds[i].tolist() for i in range(len(ds))] == sequences
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()
    assert [s.tolist() for s in pickle.loads(pickle.dumps(ds))[:]] == sequences


def test_empty_document_repeats_boundary(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "e.bin", np.uint16, vocab_size=10)
    for doc in ([], [1], [], []):
        builder.add_document(doc)
    builder.finalize(tmp_path / "e.idx")
    assert (tmp_path / "e.idx").read_bytes() == idx_bytes(8, [1], [0], [0, 0, 1, 1, 1])


def test_add_document_with_lengths_and_empty_dataset(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "l.bin", np.uint16, vocab_size=10)
    builder.add_document([4, 5, 6, 7, 8], lengths=[2, 3])
    builder.finalize(tmp_path / "l.idx")
    assert (tmp_path / "l.idx").read_bytes() == idx_bytes(8, [2, 3], [0, 4], [0, 2])
    empty = IndexedDatasetBuilder(tmp_path / "n.bin", np.uint16)
    empty.finalize(tmp_path / "n.idx")
    assert (tmp_path / "n.idx").read_bytes() == idx_bytes(8, [], [], [0])
    assert len(IndexedDataset(tmp_path / "n")) == 0


@pytest.mark.parametrize("tokens,vocab,dtype,message", [
    ([1, 50257], 50257, np.uint16, "token id 50257 in document 1 is outside [0, 50257)"),
    ([-1, 2], 50257, np.uint16, "token id -1 in document 1 is outside [0, 50257)"),
    ([65536], None, np.uint16, "token id 65536 in document 1 is outside [0, 65536)"),
    ([1.5], 100, np.uint16, "float64 values"),
])
def test_token_ids_checked_before_narrowing(tmp_path, tokens, vocab, dtype, message):
    builder = IndexedDatasetBuilder(tmp_path / "r.bin", dtype, vocab_size=vocab)
    builder.add_document([7])
    with pytest.raises(DataError, match=re.escape(message)):
        builder.add_document(tokens)
    builder.finalize(tmp_path / "r.idx")  # the rejected document left nothing behind
    assert (tmp_path / "r.bin").read_bytes() == struct.pack("<H", 7)


def test_vocab_too_big_for_dtype(tmp_path):
    with pytest.raises(DataError, match="vocab size 70000 does not fit dtype uint16"):
        IndexedDatasetBuilder(tmp_path / "v.bin", np.uint16, vocab_size=70000)


def test_outputs_appear_only_on_finalize(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "t.bin", np.uint16)
    builder.add_document([1, 2])
    assert not (tmp_path / "t.bin").exists() and (tmp_path / "t.bin.tmp").exists()
    builder.finalize(tmp_path / "t.idx")
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.idx"]

    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "u.bin", np.uint16) as builder:
            builder.add_document([1])
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.idx"]


def test_add_index_concatenates(tmp_path):
    write_example(tmp_path / "a")
    merged = IndexedDatasetBuilder(tmp_path / "m.bin", np.uint16)
    merged.add_document([9])
    merged.add_index(str(tmp_path / "a"))
    merged.add_document([])
    merged.add_index(str(tmp_path / "a"))
    merged.finalize(tmp_path / "m.idx")
    assert (tmp_path / "m.idx").read_bytes() == idx_bytes(
        8, [1, 3, 2, 3, 3, 2, 3], [0, 2, 8, 12, 18, 24, 28], [0, 1, 2, 4, 4, 5, 7])
    assert (tmp_path / "m.bin").read_bytes() == struct.pack("<H", 9) + EXAMPLE_BIN * 2

    other = IndexedDatasetBuilder(tmp_path / "o.bin", np.int32)
    with pytest.raises(DataError, match="dtype expected int32, got uint16"):
        other.add_index(str(tmp_path / "a"))


def _corrupt(idx=EXAMPLE_IDX, bin_=EXAMPLE_BIN, **fields):
    if fields:
        values = dict(code=8, lengths=[3, 2, 3], pointers=[0, 6, 10], docs=[0, 1, 3])
        values.update(fields)
        idx = idx_bytes(**values)
    return idx, bin_


@pytest.mark.parametrize("files,message", [
    (_corrupt(idx=EXAMPLE_IDX[:20]), r"ex\.idx: truncated header: expected at least 34 bytes, got 20"),
    (_corrupt(idx=b"NOTANIDX\x00" + EXAMPLE_IDX[9:]), r"ex\.idx: bad magic"),
    (_corrupt(idx=idx_bytes(8, [3, 2, 3], [0, 6, 10], [0, 1, 3], version=2)),
     r"ex\.idx: version expected 1, got 2"),
    (_corrupt(code=9), r"ex\.idx: dtype code expected one of \[1, 2, 3, 4, 5, 6, 7, 8\], got 9"),
    (_corrupt(idx=EXAMPLE_IDX[:-8]), r"ex\.idx: size expected 94 bytes .* got 86"),
    (_corrupt(idx=EXAMPLE_IDX + b"\x00"), r"ex\.idx: size expected 94 bytes .* got 95"),
    (_corrupt(docs=[1, 1, 3]), r"ex\.idx: document index must start with 0, got 1"),
    (_corrupt(docs=[0, 1, 2]), r"ex\.idx: document index must end with the sequence count 3, got 2"),
    (_corrupt(docs=[0, 2, 1, 3]), r"ex\.idx: document index decreases at entry 2: expected >= 2, got 1"),
    (_corrupt(lengths=[3, -2, 3]), r"ex\.idx: length of sequence 1 expected >= 0, got -2"),
    (_corrupt(pointers=[0, 7, 10]), r"ex\.idx: byte offset of sequence 1 expected 6 .* got 7"),
    (_corrupt(pointers=[2, 8, 12]), r"ex\.idx: byte offset of sequence 0 expected 0 .* got 2"),
    (_corrupt(bin_=EXAMPLE_BIN[:-2]), r"ex\.bin: size expected 16 bytes \(from .*ex\.idx\), got 14"),
    (_corrupt(bin_=EXAMPLE_BIN + b"\x00\x00"), r"ex\.bin: size expected 16 bytes .* got 18"),
])
def test_corrupt_files_raise_named_errors(tmp_path, files, message):
    write_files(tmp_path / "ex", *files)
    with pytest.raises(DataError, match=message):
        IndexedDataset(str(tmp_path / "ex"))


def test_missing_files(tmp_path):
    with pytest.raises(DataError, match=r"nothing\.idx: index file not found"):
        IndexedDataset(str(tmp_path / "nothing"))
    write_files(tmp_path / "ex", EXAMPLE_IDX, EXAMPLE_BIN)
    os.remove(tmp_path / "ex.bin")
    with pytest.raises(DataError, match=r"ex\.bin: data file not found"):
        IndexedDataset(str(tmp_path / "ex"))
