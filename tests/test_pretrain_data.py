"""The whole data path end to end: corpus -> tokenizer -> preprocess -> pretrain."""

import os
import subprocess
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.training import pretrain
from megalite.training_log import parse_validation_line

from tools.dataset_stats import unigram_entropy

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def tool(name, *args):
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)],
                   check=True, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def stdlib_dataset(tmp_path_factory):
    """A small slice of the embedded corpus, a 512-piece tokenizer, and its .bin/.idx."""
    d = tmp_path_factory.mktemp("stdlib")
    tool("build_stdlib_corpus.py", "--output", d / "corpus.jsonl", "--max-documents", "60")
    tool("train_tokenizer.py", "--input", d / "corpus.jsonl", "--model-prefix", d / "tok",
         "--vocab-size", "512")
    tool("preprocess_data.py", "--input", d / "corpus.jsonl", "--output-prefix", d / "stdlib",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", d / "tok.model",
         "--append-eod")
    return d


def train_flags(d, *extra):
    return ["--data-path", str(d / "stdlib_text_document"), "--split", "90,10,0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
            str(d / "tok.model"), "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "8",
            "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--attention-dropout",
            "0", "--hidden-dropout", "0", "--num-workers", "0", "--log-interval", "50",
            "--data-cache-path", str(d / "cache"), *extra]


@pytest.mark.slow
def test_loss_falls_clearly_below_unigram_entropy(stdlib_dataset, capsys):
    """The best context-free model scores the unigram entropy; a model that learned from
    context must beat it, here by at least half a nat on held-out documents."""
    d = stdlib_dataset
    entropy = unigram_entropy(IndexedDataset(str(d / "stdlib_text_document")).tokens)
    code = pretrain(train_flags(d, "--train-iters", "150", "--eval-interval", "1000",
                                "--eval-iters", "4"))
    out = capsys.readouterr().out
    assert code == 0
    loss = next(v["loss"] for v in map(parse_validation_line, out.splitlines()) if v and
                "on validation set" in v["prefix"])
    assert 4.0 < entropy < 6.5
    assert loss < entropy - 0.5


def test_unigram_entropy_closed_form():
    assert unigram_entropy(np.array([0, 1, 2, 3])) == pytest.approx(np.log(4))
    assert unigram_entropy(np.array([5, 5, 5])) == 0.0


@pytest.mark.slow
def test_missing_prefix_is_named(stdlib_dataset, capsys):
    code = pretrain(train_flags(stdlib_dataset, "--train-iters", "20", "--data-path",
                                str(stdlib_dataset / "nope")))
    assert code == 1
    assert "nope.idx not found" in capsys.readouterr().err


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary_are_refused(stdlib_dataset, tmp_path, capsys):
    """A dataset made with a bigger tokenizer than the one given to training."""
    d = stdlib_dataset
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(f'{{"text": "{" ".join(str(i % 600) for i in range(k, k + 300))}"}}\n'
                           for k in range(20)))
    tool("preprocess_data.py", "--input", ids, "--output-prefix", tmp_path / "big",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100000", "--append-eod")
    code = pretrain(train_flags(d, "--train-iters", "20", "--data-path",
                                str(tmp_path / "big_text_document")))
    err = capsys.readouterr().err
    assert code == 1
    assert "token id 100000 is outside" in err and "[0, 512)" in err  # eod = 100000
