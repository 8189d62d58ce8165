"""Blending several datasets by weight (`--data-path w1 p1 w2 p2 ...`, docs/design.md §7).

Sample i of the blend comes from the dataset furthest below its share so far: Megatron's
greedy rule, `argmax_j(weight_j * max(i, 1) - count_j)`, ties to the lowest j (its C++
`build_blending_indices`, here a Python loop). Dataset j's k-th pick is its sample k, so
each dataset is read in its own (already shuffled) order. The two indices are cached like
the GPT dataset's, under a hash of the component datasets, the weights and the size.
"""

import math
from array import array
from typing import Callable, Sequence

import numpy as np
import torch

from megalite.data.gpt_dataset import INDEX_FORMAT_VERSION, build_or_load_indices, description_hash
from megalite.errors import ConfigError, DataError

# Megatron asks each component for this much more than its share so the blend never runs dry.
SIZE_MARGIN = 1.005


def _as_weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(values: Sequence[str]) -> tuple[list[float], list[str]]:
    """`--data-path` values -> (normalised weights, prefixes).

    `["p1"]` -> one dataset; `["p1", "p2"]` -> equal weights; `["w1", "p1", "w2", "p2"]` ->
    those weights. Weighted lists are recognised by a number in first place.
    (Megatron-core instead weighs an unweighted list by dataset size.)
    """
    values = [v.strip() for v in values]
    if not values:
        raise ConfigError("--data-path: give at least one dataset prefix")
    if _as_weight(values[0]) is None:
        numeric = [v for v in values if _as_weight(v) is not None]
        if numeric:
            raise ConfigError(f"--data-path: {numeric[0]!r} looks like a weight, but the list "
                              "does not start with one; write weight-prefix pairs "
                              "'w1 p1 w2 p2 ...' or prefixes only")
        return normalize_weights([1.0] * len(values)), values
    if len(values) % 2 != 0:
        raise ConfigError(f"--data-path: {len(values)} values; a weighted list needs "
                          "weight-prefix pairs 'w1 p1 w2 p2 ...'")
    for text, prefix in zip(values[0::2], values[1::2]):
        if _as_weight(text) is None:
            raise ConfigError(f"--data-path: expected a weight before prefix {prefix!r}, "
                              f"got {text!r}")
    return normalize_weights([_as_weight(t) for t in values[0::2]]), values[1::2]


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum (in float64, as Megatron's `normalize`); each must be > 0."""
    for weight in weights:
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"--data-path: every weight must be a finite number > 0, "
                              f"got {weight}")
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def component_num_samples(num_samples: int, weights: Sequence[float]) -> list[int]:
    """Samples to build for each component of a blend of `num_samples` (Megatron's margin)."""
    return [int(math.ceil(num_samples * w * SIZE_MARGIN)) for w in weights]


def build_blending_indices(weights: Sequence[float], size: int) -> dict[str, np.ndarray]:
    """dataset_index[i] = which dataset serves blend sample i; dataset_sample_index[i] = which
    of its samples. Greedy: the dataset whose count lags its share `weight * max(i, 1)` most.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    picks = array("h", bytes(2 * size))  # int16, like Megatron's dataset index
    if len(w) > 1:
        # A plain loop (no C++ helper): ~0.5 us per sample for two datasets (5 s for 1e7),
        # built once and cached; see benchmarks/dataset_index_build.py.
        w0, others = w[0], range(1, len(w))
        for i in range(size):
            t = i if i > 1 else 1
            best, best_error = 0, w0 * t - counts[0]
            for j in others:
                error = w[j] * t - counts[j]
                if error > best_error:
                    best, best_error = j, error
            picks[i] = best
            counts[best] += 1
    dataset_index = np.frombuffer(picks, dtype=np.int16).copy()
    # Dataset j's k-th pick is its sample k.
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for j in range(len(w)):
        mine = dataset_index == j
        dataset_sample_index[mine] = np.arange(int(np.count_nonzero(mine)), dtype=np.int64)
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


class BlendedDataset(torch.utils.data.Dataset):
    """`num_samples` samples drawn from `datasets` in proportion to `weights`.

    Each component must describe itself with a `description` dict (GPTDataset does) and
    hold enough samples: build component j with `component_num_samples(...)[j]` samples.
    `cache_dir`, `is_builder` and `barrier` work as in GPTDataset.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int, *,
                 cache_dir: str | None = None, is_builder: bool = True,
                 barrier: Callable[[], None] = lambda: None):
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError(f"--data-path: {len(weights)} weights for {len(datasets)} datasets")
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ConfigError(
                f"--data-path: at most {np.iinfo(np.int16).max - 1} datasets can be blended")
        if num_samples < 0:
            raise ConfigError(f"number of blended samples must be >= 0, got {num_samples}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.description = {
            "class": "BlendedDataset", "format_version": INDEX_FORMAT_VERSION,
            "datasets": [description_hash(d.description) for d in self.datasets],
            "weights": self.weights, "num_samples": num_samples}
        self.description_hash = description_hash(self.description)
        arrays = build_or_load_indices(
            self.description, ["dataset_index", "dataset_sample_index"],
            lambda: build_blending_indices(self.weights, num_samples),
            cache_dir, is_builder, barrier)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_components_large_enough()

    def _check_components_large_enough(self) -> None:
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for j, dataset in enumerate(self.datasets):
            if counts[j] > len(dataset):
                name = dataset.description.get("name", f"dataset {j}")
                raise DataError(f"blend needs {counts[j]} samples from {name} (weight "
                                f"{self.weights[j]:.4g}) but it holds {len(dataset)}; build it "
                                "with component_num_samples()")

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
