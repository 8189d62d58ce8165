"""tools/estimate_memory.py and tools/generate.py take only the flags they use (issue 12,
item 6): their README commands run without --lr, --train-iters or a data source, and a
bad model flag is still refused by name."""

import re
import shlex
from pathlib import Path

import pytest
import sentencepiece as spm

from megalite.training import pretrain

from tests.helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "96", "--max-position-embeddings", "96"]


def readme_command(tool: str, placeholder: str, replacement: list[str]) -> list[str]:
    """The README's `python tools/<tool>.py ...` command (continuation lines joined), its
    <placeholder> replaced by real flags; the arguments after the script name."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    line = re.search(rf"^python tools/{tool}\.py .*$", text, re.M).group(0)
    assert placeholder in line, line
    line = line.replace(placeholder, shlex.join(replacement))
    return shlex.split(line)[2:]


def test_estimate_memory_readme_command(capsys):
    argv = readme_command("estimate_memory", "<model flags>", MODEL + ["--vocab-size", "500"])
    assert not {"--lr", "--train-iters", "--train-samples", "--mock-data",
                "--data-path"} & set(argv)
    assert load_tool("estimate_memory").main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "TP 2 x PP 1 x DP 16" in out and "global batch 256" in out
    assert "vocabulary 512 (padded)" in out and "most loaded: PP rank 0" in out


@pytest.mark.parametrize("extra, words", [
    (["--num-attention-heads", "3"], ["--hidden-size=64", "--num-attention-heads=3"]),
    (["--seq-length", "0"], ["--seq-length must be positive, got 0"]),
    (["--global-batch-size", "100"], ["--global-batch-size=100", "--micro-batch-size=1"]),
])
def test_estimate_memory_refuses_bad_model_flags_by_name(extra, words, capsys):
    argv = readme_command("estimate_memory", "<model flags>", MODEL + ["--vocab-size", "500"])
    assert load_tool("estimate_memory").main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for word in words:
        assert word in err, err


def test_estimate_memory_needs_the_micro_batch(capsys):
    argv = ["--world-size", "2", *MODEL, "--vocab-size", "500"]
    assert load_tool("estimate_memory").main(argv) == 2
    assert "--micro-batch-size" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tokenizer_and_checkpoint(tmp_path_factory):
    """A small SentencePiece model and a one-iteration checkpoint of MODEL with it."""
    tmp = tmp_path_factory.mktemp("tools")
    lines = [f"def f{i}(x):\n    return x + {i}" for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp / "tok"),
                                   vocab_size=100, model_type="bpe", eos_id=1, bos_id=-1,
                                   pad_id=-1, unk_id=0)
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                 str(tmp / "tok.model")]
    assert pretrain([*MODEL, *tokenizer, "--mock-data", "--micro-batch-size", "1",
                     "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0",
                     "--num-workers", "0", "--save", str(tmp / "ckpt")]) == 0
    return tokenizer, str(tmp / "ckpt")


def generate_argv(tokenizer_and_checkpoint, *extra):
    tokenizer, ckpt = tokenizer_and_checkpoint
    argv = readme_command("generate", "<model and tokenizer flags>",
                          MODEL + list(extra) + tokenizer)
    return [ckpt if a == "ckpt/run1" else a for a in argv]


def test_generate_readme_command(tokenizer_and_checkpoint, capsys):
    argv = generate_argv(tokenizer_and_checkpoint)
    assert not {"--lr", "--train-iters", "--micro-batch-size", "--mock-data"} & set(argv)
    capsys.readouterr()
    assert load_tool("generate").main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert " > loaded iteration 1 from" in out
    ids = re.search(r"^ > generated token ids: (.*)$", out, re.M).group(1).split()
    assert 1 <= len(ids) <= 64 and all(0 <= int(t) < 100 for t in ids)


@pytest.mark.parametrize("extra, words", [
    (["--num-attention-heads", "3"], ["--hidden-size=64", "--num-attention-heads=3"]),
    (["--kv-channels", "15", "--position-embedding-type", "rope"],
     ["--kv-channels=15", "even"]),
])
def test_generate_refuses_bad_model_flags_by_name(tokenizer_and_checkpoint, extra, words,
                                                  capsys):
    capsys.readouterr()
    assert load_tool("generate").main(generate_argv(tokenizer_and_checkpoint, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for word in words:
        assert word in err, err
