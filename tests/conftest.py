"""Shared test helpers: a small valid flag set every test starts from."""

import pytest

BASE_FLAGS = [
    "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "64",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--train-iters", "10", "--lr", "1e-3",
]


@pytest.fixture
def base_flags():
    return list(BASE_FLAGS)
