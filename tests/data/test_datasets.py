"""From the data flags to a run's datasets (data/datasets.py): what cannot be trained on is
refused by name before the first step, not met as an infinite loss or a TypeError in it."""

import numpy as np
import pytest

from megalite.arguments import parse_args
from megalite.data.datasets import build_datasets
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.errors import DataError
from megalite.validation import validate_args

from tests.helpers import BASE_FLAGS, without

# NullTokenizer --vocab-size 60: ids 0..59 and its end-of-document 60, so a vocabulary of
# 61, padded to 128 rows (the default --make-vocab-size-divisible-by).
TOKENIZER_VOCAB = 61


def dataset(tmp_path, documents, name="corpus") -> str:
    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for tokens in documents:
        builder.add_document(np.array(tokens, dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    return prefix


def build(tmp_path, prefix, *flags):
    args = parse_args([*without(BASE_FLAGS, "--mock-data", "--vocab-size",
                                "--make-vocab-size-divisible-by"), "--data-path", prefix,
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
                       "--data-cache-path", str(tmp_path / "cache"), *flags])
    config = validate_args(args, 1, TOKENIZER_VOCAB)
    assert config.model.padded_vocab_size == 128
    return build_datasets(config, TOKENIZER_VOCAB - 1, is_builder=True, barrier=lambda: None)


def test_a_token_id_in_the_vocabulary_padding_is_refused(tmp_path):
    """Ids 61..127 have embedding rows (padding), whose logits are masked: the first step's
    loss would be infinite."""
    documents = [list(range(k, k + 40)) for k in range(0, 20, 2)]
    documents[3][5] = 100
    prefix = dataset(tmp_path, documents)
    with pytest.raises(DataError, match=rf"--data-path {prefix}: token id 100 is outside the "
                       r"tokenizer's vocabulary \[0, 61\)"):
        build(tmp_path, prefix)
    train, _, _ = build(tmp_path, dataset(tmp_path, documents[:3] + documents[4:], "ok"))
    assert len(train) > 0


@pytest.mark.parametrize("documents, split, message", [
    ([list(range(40))] * 10, "0,100,0", "--split 0,100,0 gives the training set none of its "
                                        "10 documents"),
    ([list(range(40))] * 10, "1,99,0", "--split 1,99,0 gives the training set none of its "
                                       "10 documents"),
    ([], "969,30,1", "it holds none"),  # preprocessed from an empty file
])
def test_no_documents_to_train_on_is_refused(tmp_path, documents, split, message):
    prefix = dataset(tmp_path, documents)
    with pytest.raises(DataError, match=f"--data-path {prefix}: no documents to train on: "
                       + message):
        build(tmp_path, prefix, "--split", split)


def test_validation_and_test_sets_may_be_empty(tmp_path):
    train, valid, test = build(tmp_path, dataset(tmp_path, [list(range(40))] * 10),
                               "--split", "100,0,0")
    assert len(train) > 0 and valid is None and test is None
