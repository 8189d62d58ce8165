"""Blending and --data-path parsing, against Megatron's C++ loop transcribed and the weights."""

import os

import numpy as np
import pytest
import torch

from megalite.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    component_num_samples,
    parse_data_path,
)
from megalite.errors import ConfigError, DataError


class ListDataset:
    """A component: sample k of dataset `tag` is {"tokens": [tag, k]}."""

    def __init__(self, tag, size):
        self.tag, self.size = tag, size
        self.description = {"class": "ListDataset", "name": f"d{tag}", "size": size}

    def __len__(self):
        return self.size

    def __getitem__(self, k):
        if not 0 <= k < self.size:
            raise IndexError(k)
        return {"tokens": torch.tensor([self.tag, k])}


def megatron_blending(weights, size):
    """Megatron's C++ `build_blending_indices`, transcribed."""
    counts = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for i in range(size):
        t = max(float(i), 1.0)
        best, best_error = 0, weights[0] * t - counts[0]
        for j in range(1, len(weights)):
            error = weights[j] * t - counts[j]
            if error > best_error:
                best, best_error = j, error
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, dataset_sample_index


# ---------------------------------------------------------------------------- --data-path

def test_parse_data_path_forms():
    assert parse_data_path(["a/b_text_document"]) == ([1.0], ["a/b_text_document"])
    assert parse_data_path(["p1", "p2"]) == ([0.5, 0.5], ["p1", "p2"])
    weights, prefixes = parse_data_path(["30", "p1", "70", "p2"])
    assert prefixes == ["p1", "p2"] and weights == pytest.approx([0.3, 0.7])
    weights, prefixes = parse_data_path(["0.2", "p1", "1e-1", "p2", "0.1", "p3"])
    assert prefixes == ["p1", "p2", "p3"] and weights == pytest.approx([0.5, 0.25, 0.25])


@pytest.mark.parametrize("values,match", [
    ([], "at least one"),
    (["0.3", "p1", "0.7"], "pairs"),
    (["0.3", "p1", "p2", "p3"], "weight before prefix 'p3'"),
    (["0", "p1", "1", "p2"], "> 0"),
    (["-1", "p1", "2", "p2"], "> 0"),
    (["nan", "p1", "1", "p2"], "> 0"),
    (["p1", "0.5", "p2"], "looks like a weight"),
])
def test_parse_data_path_errors_name_the_flag(values, match):
    with pytest.raises(ConfigError, match="--data-path") as err:
        parse_data_path(values)
    assert err.match(match)


# ---------------------------------------------------------------------------- blending

@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.3, 0.7], [0.2, 0.3, 0.5], [0.05, 0.9, 0.05],
                                     [0.11, 0.07, 0.19, 0.23, 0.4]])
def test_blending_matches_megatron_loop(weights):
    weights = list(np.array(weights) / np.sum(weights))
    got = build_blending_indices(weights, 3000)
    dataset_index, dataset_sample_index = megatron_blending(weights, 3000)
    assert got["dataset_index"].dtype == np.int16 and got["dataset_sample_index"].dtype == np.int64
    np.testing.assert_array_equal(got["dataset_index"], dataset_index)
    np.testing.assert_array_equal(got["dataset_sample_index"], dataset_sample_index)


def test_blended_shares_within_one_percent_of_weights():
    weights = [0.17, 0.33, 0.5]
    n = 20000
    indices = build_blending_indices(weights, n)
    counts = np.bincount(indices["dataset_index"], minlength=3)
    np.testing.assert_allclose(counts / n, weights, atol=0.01)
    # And at every prefix the count is within a couple of samples of weight * prefix.
    for j, w in enumerate(weights):
        running = np.cumsum(indices["dataset_index"] == j)
        assert np.max(np.abs(running - w * np.arange(1, n + 1))) < 2


def test_single_dataset_and_empty_blend():
    one = build_blending_indices([1.0], 5)
    np.testing.assert_array_equal(one["dataset_index"], np.zeros(5))
    np.testing.assert_array_equal(one["dataset_sample_index"], np.arange(5))
    assert len(build_blending_indices([0.5, 0.5], 0)["dataset_index"]) == 0


def test_blended_dataset_serves_component_samples_in_order():
    weights = [0.25, 0.75]
    sizes = component_num_samples(400, weights)
    assert sizes == [int(np.ceil(400 * w * 1.005)) for w in weights]
    datasets = [ListDataset(0, sizes[0]), ListDataset(1, sizes[1])]
    blend = BlendedDataset(datasets, weights, 400)
    assert len(blend) == 400
    seen = [blend[i]["tokens"].tolist() for i in range(400)]
    for tag in (0, 1):
        ks = [k for t, k in seen if t == tag]
        assert ks == list(range(len(ks)))  # each component read in its own order, no repeats
    shares = np.bincount([t for t, _ in seen]) / 400
    np.testing.assert_allclose(shares, weights, atol=0.01)
    with pytest.raises(IndexError):
        blend[400]


def test_too_small_component_is_a_data_error():
    with pytest.raises(DataError, match="d1"):
        BlendedDataset([ListDataset(0, 100), ListDataset(1, 10)], [0.5, 0.5], 100)


@pytest.mark.parametrize("weights", [[0.0, 1.0], [-1.0, 2.0], [float("inf"), 1.0]])
def test_non_positive_weights_name_data_path(weights):
    with pytest.raises(ConfigError, match="--data-path"):
        BlendedDataset([ListDataset(0, 10), ListDataset(1, 10)], weights, 5)


def test_weights_and_datasets_must_pair_up():
    with pytest.raises(ConfigError, match="--data-path"):
        BlendedDataset([ListDataset(0, 10)], [0.5, 0.5], 5)


# ---------------------------------------------------------------------------- cache

def test_blend_cache_hit_and_key(tmp_path):
    datasets = [ListDataset(0, 300), ListDataset(1, 300)]
    calls = []
    built = BlendedDataset(datasets, [1, 2], 300, cache_dir=str(tmp_path),
                           barrier=lambda: calls.append(1))
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3 and all(f.startswith(built.description_hash) for f in files)
    loaded = BlendedDataset(datasets, [1, 2], 300, cache_dir=str(tmp_path), is_builder=False,
                            barrier=lambda: calls.append(1))
    assert calls == [1, 1]
    np.testing.assert_array_equal(built.dataset_index, loaded.dataset_index)
    np.testing.assert_array_equal(built.dataset_sample_index, loaded.dataset_sample_index)
    others = [
        BlendedDataset(datasets, [1, 3], 300, cache_dir=str(tmp_path)),
        BlendedDataset(datasets, [1, 2], 299, cache_dir=str(tmp_path)),
        BlendedDataset([ListDataset(0, 300), ListDataset(1, 301)], [1, 2], 300, cache_dir=str(tmp_path)),
    ]
    assert len({built.description_hash, *(o.description_hash for o in others)}) == 4
    assert len(os.listdir(tmp_path)) == 12
