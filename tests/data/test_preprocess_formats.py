"""tools/preprocess_data.py on Parquet, Arrow (datasets.save_to_disk) and compressed JSONL
shards, and tools/merge_datasets.py: each gives the bytes of the same documents preprocessed
as one JSONL file (whose bytes tests/data/test_preprocess.py checks against the format)."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset

from tests.helpers import ROOT, load_tool

pa = pytest.importorskip("pyarrow", reason="pip install -e .[parquet]")
pq = pytest.importorskip("pyarrow.parquet", reason="pip install -e .[parquet]")
zstd = pytest.importorskip("zstandard", reason="pip install -e .[zstd]")
datasets = pytest.importorskip("datasets", reason="pip install -e .[datasets]")

preprocess_data = load_tool("preprocess_data")
merge_datasets = load_tool("merge_datasets")
SHARDS = [(0, 9), (9, 10), (10, 24)]  # one single-document shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """24 documents of the embedded corpus (one made empty), as JSONL, and a tokenizer."""
    d = tmp_path_factory.mktemp("corpus")
    tool = [sys.executable, str(ROOT / "tools" / "build_stdlib_corpus.py")]
    subprocess.run(tool + ["--output", str(d / "all.jsonl"), "--max-documents", "24"],
                   check=True, capture_output=True)
    docs = [json.loads(line)["text"][:4000] for line in open(d / "all.jsonl")]
    docs[5] = ""
    write_jsonl(d / "all.jsonl", docs)
    subprocess.run([sys.executable, str(ROOT / "tools" / "train_tokenizer.py"), "--input",
                    str(d / "all.jsonl"), "--model-prefix", str(d / "tok"), "--vocab-size",
                    "400"], check=True, capture_output=True)
    return d, docs


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))


def run(inputs, prefix, model, *flags):
    """The tool as users run it: in a process of its own (forking its worker pool from
    this one, where pyarrow's threads have run, can deadlock)."""
    argv = ["--input", str(inputs), "--output-prefix", str(prefix), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", str(model), "--append-eod", *flags]
    return subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *argv],
                          capture_output=True, text=True, timeout=120)


def pair(prefix, suffix="_text_document"):
    return tuple(open(f"{prefix}{suffix}{ext}", "rb").read() for ext in (".bin", ".idx"))


def jsonl_bytes(docs):
    return "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()


def zstd_frames(docs):
    """Two concatenated zstd frames, as pzstd and split-then-compress shards write, the
    second starting at line 4."""
    return b"".join(zstd.ZstdCompressor().compress(jsonl_bytes(part))
                    for part in (docs[:3], docs[3:]))


def write_shards(d, docs):
    (d / "jsonl").mkdir()
    shards = [docs[a:b] for a, b in SHARDS]
    (d / "jsonl" / "0.jsonl").write_bytes(jsonl_bytes(shards[0]))
    (d / "jsonl" / "1.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(shards[1])))
    (d / "jsonl" / "2.jsonl.zst").write_bytes(zstd_frames(shards[2]))
    (d / "parquet").mkdir()
    for i, (a, b) in enumerate(SHARDS):  # row groups of 4: batches cross them
        pq.write_table(pa.table({"id": list(range(a, b)), "text": docs[a:b]}),
                       d / "parquet" / f"part-{i}.parquet", row_group_size=4)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(d / "hf"), num_shards=3)
    table = pa.table({"text": docs})  # an Arrow IPC file (random access), batches of 5
    with pa.ipc.new_file(d / "table.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=5)


@pytest.mark.slow  # a worker pool
def test_every_format_gives_the_jsonl_bytes_and_merge_the_concatenation(corpus, tmp_path):
    d, docs = corpus
    model = d / "tok.model"
    assert run(d / "all.jsonl", tmp_path / "ref", model).returncode == 0
    reference = pair(tmp_path / "ref")
    write_shards(tmp_path, docs)
    for name, inputs, workers in [("jsonl", tmp_path / "jsonl", 2),
                                  ("parquet", tmp_path / "parquet", 2),
                                  ("glob", tmp_path / "parquet" / "part-*.parquet", 1),
                                  ("arrow", tmp_path / "hf", 1),
                                  ("arrow file", tmp_path / "table.arrow", 1)]:
        name = name.replace(" ", "_")
        assert run(inputs, tmp_path / name, model, "--workers", str(workers)).returncode == 0
        assert pair(tmp_path / name) == reference, name

    (tmp_path / "shards").mkdir()
    assert run(tmp_path / "parquet", tmp_path / "shards" / "out", model,
               "--output-per-input").returncode == 0
    whole = IndexedDataset(str(tmp_path / "ref_text_document"))
    ends = np.concatenate([[0], np.cumsum(whole.sequence_lengths)])
    for i, (a, b) in enumerate(SHARDS):  # each shard's output holds its documents' tokens
        shard = IndexedDataset(str(tmp_path / "shards" / f"out_part-{i}_text_document"))
        assert len(shard.document_indices) - 1 == b - a
        first, last = whole.document_indices[a], whole.document_indices[b]
        assert np.array_equal(shard.tokens, whole.tokens[ends[first]:ends[last]])
    assert merge_datasets.main(["--input", str(tmp_path / "shards"),
                                "--output-prefix", str(tmp_path / "merged")]) == 0
    assert pair(tmp_path / "merged", suffix="") == reference


def outputs(directory):
    return sorted(p.name for p in directory.iterdir() if "_document" in p.name
                  or p.name.endswith(".tmp"))


def many_rows(docs):
    """100 short documents: the tool reads Parquet in batches of 64 rows."""
    return [docs[i % len(docs)][:150] for i in range(100)]


def corrupt_page(path, docs):
    """Parquet with page checksums whose second row group (rows 65-100, one page) has bytes
    flipped in its page: rows 1-64 read, row 65 on do not."""
    pq.write_table(pa.table({"text": many_rows(docs)}), path, row_group_size=64,
                   use_dictionary=False, write_page_checksum=True)
    data = bytearray(path.read_bytes())
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle:middle + 32] = bytes(b ^ 0x5A for b in data[middle:middle + 32])
    path.write_bytes(bytes(data))


BAD = {  # name: (file name, writer, expected message after the path)
    "null cell": ("a.parquet", lambda p, docs: pq.write_table(
        pa.table({"text": docs[:2] + [None] + docs[3:6]}), p), ": row 3: key 'text' is null"),
    "missing column": ("a.parquet", lambda p, docs: pq.write_table(
        pa.table({"content": docs[:6]}), p),
        ": row 1: no column 'text' for --json-keys (columns: content)"),
    "corrupt page": ("a.parquet", corrupt_page, ": row 65: cannot read on: "),
    "not parquet": ("a.parquet", lambda p, docs: p.write_bytes(b"PAR1 not really"),
                    ": row 1: not a readable Parquet file"),
    # gzip gives back all it can decompress: the last line is cut; zstd decodes whole
    # blocks: the second frame (lines 4-6, one block) is lost.
    "truncated gzip": ("a.jsonl.gz", lambda p, docs: p.write_bytes(
        gzip.compress(jsonl_bytes(docs[6:12]))[:-12]),
        ":6: cannot read on: Compressed file ended"),
    "truncated zstd": ("a.jsonl.zst", lambda p, docs: p.write_bytes(
        zstd_frames(docs[6:12])[:-12]),
        ":4: cannot read on: zstd stream ended inside a frame"),
}


@pytest.mark.slow  # a worker pool
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_shard_named_with_file_and_row(corpus, tmp_path, case):
    d, docs = corpus
    name, write, message = BAD[case]
    (tmp_path / "in").mkdir()
    write(tmp_path / "in" / name, docs)
    write_jsonl(tmp_path / "in" / "b.jsonl", docs[12:14])
    result = run(tmp_path / "in", tmp_path / "out", d / "tok.model")
    assert result.returncode == 1
    assert f"error: {tmp_path / 'in' / name}{message}" in result.stderr
    assert outputs(tmp_path) == []
    if case in ("null cell", "corrupt page"):  # skip: what was read, then the next file
        result = run(tmp_path / "in", tmp_path / "out", d / "tok.model", "--on-error", "skip")
        assert result.returncode == 0, result.stderr
        assert "skipped" in result.stderr
        kept = docs[:2] + docs[3:6] if case == "null cell" else many_rows(docs)[:64]
        write_jsonl(tmp_path / "ref.jsonl", kept + docs[12:14])
        assert run(tmp_path / "ref.jsonl", tmp_path / "ref", d / "tok.model").returncode == 0
        assert pair(tmp_path / "out") == pair(tmp_path / "ref")


@pytest.mark.parametrize("module,name,extra", [("pyarrow", "a.parquet", "parquet"),
                                               ("zstandard", "a.jsonl.zst", "zstd")])
def test_missing_optional_dependency_names_the_extra(tmp_path, capsys, monkeypatch, module,
                                                     name, extra):
    (tmp_path / name).write_bytes(b"")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    assert preprocess_data.main(["--input", str(tmp_path / name), "--output-prefix",
                                 str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                                 "--vocab-size", "10"]) == 1
    assert f"needs {module}, which is not installed: pip install -e .[{extra}]" in \
        capsys.readouterr().err


# Runs a command and prints the peak RSS in KiB of the largest process it started (the
# tool or one of its workers): RUSAGE_CHILDREN covers every waited-for descendant.
PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
            "capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


@pytest.mark.slow  # a worker pool
def test_memory_stays_below_the_input_size(tmp_path):
    """240 MB of text (compressed to a few KB of Parquet) preprocessed by processes that
    never hold more than a fraction of it: the tool streams batches, whatever the input
    size. The documents are mostly spaces so tokenizing them costs little."""
    docs, size = 12_000, 20_000
    text = " " * (size - 5) + "1 2 3"
    path = tmp_path / "big.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="zstd") as w:
        for _ in range(docs // 1000):
            w.write_table(pa.table({"text": [text] * 1000}))
    tool = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(path),
            "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10", "--workers", "2"]
    peak_kib = int(subprocess.run([sys.executable, "-c", PEAK_RSS, *tool], check=True,
                                  capture_output=True, text=True, timeout=120).stdout)
    assert len(IndexedDataset(str(tmp_path / "out_text_document")).tokens) == 3 * docs
    assert peak_kib * 1024 < docs * size, f"peak RSS {peak_kib / 1024:.0f} MiB"


def test_merge_refuses_a_file_without_its_pair(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.bin").write_bytes(b"")
    assert merge_datasets.main(["--input", str(tmp_path / "in"),
                                "--output-prefix", str(tmp_path / "merged")]) == 1
    assert f"--input {tmp_path / 'in'}: a.idx not found" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
