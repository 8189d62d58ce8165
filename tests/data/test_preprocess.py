"""tools/preprocess_data.py run as users run it, its output checked against .bin/.idx bytes
written by hand from the format and the tokenizer library's own ids."""

import gzip
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parents[2]
PREPROCESS = ROOT / "tools" / "preprocess_data.py"
TRAIN_TOKENIZER = ROOT / "tools" / "train_tokenizer.py"


def megatron_files(documents, vocab_size):
    """(.idx, .bin) bytes for documents given as lists of sequences, per docs/design.md §7."""
    code, fmt, size = (8, "H", 2) if vocab_size < 65500 else (4, "i", 4)
    sequences = [seq for doc in documents for seq in doc]
    lengths = [len(seq) for seq in sequences]
    pointers = [size * sum(lengths[:i]) for i in range(len(lengths))]
    docs = [0]
    for doc in documents:
        docs.append(docs[-1] + len(doc))
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(docs))
           + struct.pack(f"<{len(lengths)}i", *lengths)
           + struct.pack(f"<{len(pointers)}q", *pointers)
           + struct.pack(f"<{len(docs)}q", *docs))
    tokens = [t for seq in sequences for t in seq]
    return idx, struct.pack(f"<{len(tokens)}{fmt}", *tokens)


def preprocess(input_path, prefix, *flags):
    return subprocess.run([sys.executable, str(PREPROCESS), "--input", str(input_path),
                           "--output-prefix", str(prefix), *flags],
                          capture_output=True, text=True, cwd=ROOT)


def read_output(prefix, key="text"):
    base = f"{prefix}_{key}_document"
    return Path(base + ".idx").read_bytes(), Path(base + ".bin").read_bytes()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    syllables = "ka to ri mu sen pol dra fi zu ne the qu ick bro wn fox".split()
    lines = [" ".join(a + b for a in syllables for b in syllables[i % 5::5]) for i in range(60)]
    (tmp / "corpus.txt").write_text("\n".join(lines) + "\nnaïve café 東京 🙂\n", encoding="utf-8")
    subprocess.run([sys.executable, str(TRAIN_TOKENIZER), "--input", str(tmp / "corpus.txt"),
                    "--model-prefix", str(tmp / "tok"), "--vocab-size", "400"],
                   check=True, capture_output=True)
    return tmp / "tok.model"


GOOD, EMPTY = "good", "empty"
MESSY_LINES = [  # (bytes of the line, what it is)
    (json.dumps({"text": "naïve café, 東京 🙂\ttab  kato"}).encode(), GOOD),
    (b'{"text": ""}', EMPTY),
    (b'{"text": "never closed', "malformed JSON: Unterminated string"),
    (json.dumps({"text": "second rimu fox", "id": 4}).encode(), GOOD),
    (b'{"title": "no text here"}', "missing key 'text'"),
    (b'{"text": "bad \xff byte"}', "invalid UTF-8 at byte 14"),
    (json.dumps({"text": ["first kato", "", "second"]}).encode(), GOOD),
    (json.dumps({"text": 42}).encode(), "key 'text': expected a string or a list of strings"),
    (b'{"text": ""}', EMPTY),
    (b'{"text": "lone \\ud800 surrogate"}', "key 'text': lone surrogate at character 5"),
    (json.dumps({"text": "last line, no newline"}).encode(), GOOD),
]


def write_messy(path):
    data = b"\n".join(line for line, _ in MESSY_LINES)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def expected_messy(sp_model):
    """Megatron's encoding of the usable lines: one sequence per non-empty string, eod last."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    documents = []
    for line, kind in MESSY_LINES:
        if kind not in (GOOD, EMPTY):
            continue
        text = json.loads(line)["text"]
        sequences = [sp.encode_as_ids(s) for s in (text if isinstance(text, list) else [text])]
        sequences = [s for s in sequences if s]
        if sequences:
            sequences[-1].append(sp.eos_id())
        documents.append(sequences)
    return megatron_files(documents, len(sp))


def sp_flags(sp_model, *extra):
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(sp_model),
            "--append-eod", *extra]


@pytest.mark.parametrize("name,flags", [
    ("in.jsonl", ["--workers", "1"]),
    ("in.jsonl", ["--workers", "2"]),
    ("in.jsonl", ["--workers", "2", "--partitions", "2"]),
    ("in.jsonl.gz", ["--workers", "2"]),
])
def test_skip_mode_reports_and_matches_reference(tmp_path, sp_model, name, flags):
    write_messy(tmp_path / name)
    result = preprocess(tmp_path / name, tmp_path / "out",
                        *sp_flags(sp_model, "--on-error", "skip", "--log-interval", "4", *flags))
    assert result.returncode == 0, result.stderr
    assert read_output(tmp_path / "out") == expected_messy(sp_model)
    for lineno, (_, kind) in enumerate(MESSY_LINES, start=1):
        if kind not in (GOOD, EMPTY):
            assert f"{tmp_path / name}:{lineno}: {kind}" in result.stderr
    assert "5 skipped" in result.stdout
    assert "6 documents (2 empty)" in result.stdout
    assert "docs/s" in result.stderr and "MB/s" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [name, "out_text_document.bin", "out_text_document.idx"])


def test_fail_mode_stops_at_first_bad_line_and_writes_nothing(tmp_path, sp_model):
    write_messy(tmp_path / "in.jsonl")
    for workers in ("1", "2"):
        result = preprocess(tmp_path / "in.jsonl", tmp_path / "out",
                            *sp_flags(sp_model, "--workers", workers))
        assert result.returncode == 1
        assert f"error: {tmp_path / 'in.jsonl'}:3: malformed JSON" in result.stderr
        assert "missing key" not in result.stderr
        assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


@pytest.mark.parametrize("line,reason", [(line, kind) for line, kind in MESSY_LINES
                                         if kind not in (GOOD, EMPTY)])
def test_fail_mode_names_each_kind_of_bad_line(tmp_path, line, reason):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "1 2"}\n' + line + b"\n")
    result = preprocess(tmp_path / "in.jsonl", tmp_path / "out",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert result.returncode == 1
    assert f"{tmp_path / 'in.jsonl'}:2: {reason}" in result.stderr


def test_null_tokenizer_exact_bytes_for_two_keys(tmp_path):
    lines = [{"text": "1 2 3", "code": "7"}, {"text": "", "code": "8 9"},
             {"text": ["4 5", "", "6"], "code": ""}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = preprocess(tmp_path / "in.jsonl", tmp_path / "out", "--json-keys", "text", "code",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                        "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    # NullTokenizer(10): eod is 10, vocab 11, as in Megatron.
    assert read_output(tmp_path / "out", "text") == megatron_files(
        [[[1, 2, 3, 10]], [], [[4, 5], [6, 10]]], 11)
    assert read_output(tmp_path / "out", "code") == megatron_files(
        [[[7, 10]], [[8, 9, 10]], []], 11)
    assert "3 documents (1 empty), 3 sequences, 8 tokens" in result.stdout


def test_token_id_outside_vocab(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "1 2"}\n{"text": "3 11"}\n')
    result = preprocess(tmp_path / "in.jsonl", tmp_path / "out",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert result.returncode == 1
    assert "in.jsonl:2: token id 11 outside the vocabulary [0, 11)" in result.stderr


def test_bad_flags(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n')
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    result = preprocess(tmp_path / "in.jsonl", tmp_path / "out", *null,
                        "--workers", "3", "--partitions", "2")
    assert result.returncode == 1
    assert "--workers 3 must be a multiple of --partitions 2" in result.stderr
    result = preprocess(tmp_path / "missing.jsonl", tmp_path / "out", *null)
    assert result.returncode == 1 and "missing.jsonl: file not found" in result.stderr
    result = preprocess(tmp_path / "in.jsonl", tmp_path / "out", "--append-eod",
                        "--tokenizer-type", "NullTokenizer")
    assert result.returncode == 1 and "NullTokenizer needs --vocab-size" in result.stderr
