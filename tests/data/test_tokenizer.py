"""Tokenizers against the libraries they wrap, and tools/train_tokenizer.py end to end."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from megalite.data.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from megalite.errors import ConfigError, DataError

TRAIN_TOKENIZER = Path(__file__).resolve().parents[2] / "tools" / "train_tokenizer.py"
CODE = 'def f(x):\n    """Return x, plus one."""\n\treturn  x + 1  # done\n'
UNICODE = "naïve café, 東京, αβγ, emoji 🙂 and <EOD> </s> as plain text\r\n"


def corpus_lines():
    """200 lines of made-up words from syllables: enough distinct text for 400 pieces."""
    syllables = "ka to ri mu sen pol dra fi zu ne the qu ick bro wn fox".split()
    words = [a + b + c for a in syllables for b in syllables[::3] for c in ("", "s", "ing")]
    return [" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)) + f" = f({i})"
            for i in range(200)]


def train(tmp_path, *flags, input_name="corpus.jsonl"):
    path = tmp_path / input_name
    docs = ["\n".join(corpus_lines()[i:i + 20]) + "\n" + CODE for i in range(0, 200, 20)]
    if input_name.endswith(".txt"):
        path.write_text("\n".join(docs), encoding="utf-8")
    else:
        lines = "".join(json.dumps({"body": d}) + "\n" for d in docs).encode()
        path.write_bytes(gzip.compress(lines) if input_name.endswith(".gz") else lines)
    result = subprocess.run(
        [sys.executable, str(TRAIN_TOKENIZER), "--input", str(path), "--json-key", "body",
         "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "400", *flags],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return tmp_path / "tok.model"


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train(tmp_path_factory.mktemp("sp"))


@pytest.mark.slow
def test_sentencepiece_matches_library(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(sp_model))
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    for text in (CODE, UNICODE, ""):
        # Special-token strings are ordinary text, as in Megatron's non-legacy tokenizer.
        assert tok.tokenize(text) == sp.encode_as_ids(text)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (400, sp.eos_id(), None, None)
    assert tok.eod == 1 and sp.id_to_piece(0) == "<unk>" and sp.id_to_piece(1) == "</s>"
    # identity normalization + byte fallback: text (tabs, double spaces, CJK) round-trips
    assert tok.detokenize(tok.tokenize(CODE)) == CODE
    assert tok.detokenize(tok.tokenize(UNICODE)) == UNICODE


@pytest.mark.slow
def test_train_tokenizer_options(tmp_path):
    model = train(tmp_path, "--bos", "--pad", "--model-type", "unigram",
                  input_name="corpus.jsonl.gz")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    proto = sentencepiece_model_pb2.ModelProto.FromString(model.read_bytes())
    assert proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "</s>", "<s>", "<pad>"]
    tok = SentencePieceTokenizer(str(model))
    assert (tok.eod, tok.bos, tok.pad) == (1, 2, 3)
    assert tok.tokenize(UNICODE) == sp.encode_as_ids(UNICODE)


@pytest.mark.slow
def test_train_tokenizer_txt_input_and_temp_name(tmp_path):
    model = train(tmp_path, "--no-byte-fallback", input_name="corpus.txt")
    assert not list(tmp_path.glob("*.tmp"))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert not any(sp.is_byte(i) for i in range(len(sp)))


@pytest.mark.slow
def test_train_tokenizer_reports_bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"other": 1}\n')
    result = subprocess.run(
        [sys.executable, str(TRAIN_TOKENIZER), "--input", str(path),
         "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "50"],
        capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{path}:2: no string under 'text'" in result.stderr
    assert not list(tmp_path.glob("tok*"))


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def test_gpt2_bpe_against_hand_applied_merges(tmp_path):
    byte_char = bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}  # id of a single byte = its value
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    for merge in merges:
        vocab[merge.replace(" ", "")] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                         encoding="utf-8")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                          merge_file=str(tmp_path / "merges.txt"))
    hello, gw = vocab["hello"], vocab["Ġw"]
    assert tok.tokenize("hello world") == [hello, gw, *b"orld"]
    assert tok.tokenize("é") == list("é".encode())  # bytes c3 a9
    assert tok.tokenize("<|endoftext|>") == list(b"<|endoftext|>")  # not special in text
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (262, 261, None, None)
    assert tok.detokenize(tok.tokenize("hello  wörld\n")) == "hello  wörld\n"


def test_huggingface_tokenizer_matches_library(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    lib = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    lib.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120,
                                             special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    lib.train_from_iterator(corpus_lines(), trainer)
    lib.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    lib.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": {"content": "<s>"}, "pad_token": "<pad>"}))

    for path in (tmp_path, tmp_path / "tokenizer.json"):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
        text = "the lazy fox runs"
        assert tok.tokenize(text) == lib.encode(text).ids and tok.tokenize(text)[0] == 1
        assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (lib.get_vocab_size(), 2, 1, 3)
        assert tok.detokenize(lib.encode(text).ids) == lib.decode(lib.encode(text).ids,
                                                                  skip_special_tokens=False)
    (tmp_path / "tokenizer_config.json").unlink()
    assert HuggingFaceTokenizer(str(tmp_path)).eod is None


def test_huggingface_without_library(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"needs the `tokenizers` package: pip install"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_null_tokenizer_follows_megatron():
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (101, 100, None, None)
    assert tok.tokenize("5 17  3\n") == [5, 17, 3] and tok.tokenize("") == []
    assert tok.detokenize([5, 17, 3]) == "5 17 3"
    with pytest.raises(DataError, match="whitespace-separated integer ids"):
        tok.tokenize("5 seven")


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="SentencePieceTokenizer needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(DataError, match=r"--tokenizer-model .*nope\.model: file not found"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    with pytest.raises(ConfigError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=__file__)
    with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ConfigError, match="--tokenizer-type: expected one of"):
        build_tokenizer("BertWordPieceCase")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "junk.model"))
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(DataError, match="no <\\|endoftext\\|> token"):
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
