"""From the data flags to the train, valid and test datasets of a run.

`--mock-data` gives synthetic counting documents; otherwise `--data-path` names one or more
indexed datasets (optionally weighted), each split into train/valid/test documents by
`--split`, cut into GPT samples and, with several prefixes, blended by weight. Each split
holds as many samples as the run will read: train_iters x global batch for training, one
--eval-iters block per evaluation for validation, one block for the final test.
"""

import os

import numpy as np

from megalite.config import Config, DataConfig
from megalite.data.blended_dataset import BlendedDataset, component_num_samples, parse_data_path
from megalite.data.gpt_dataset import GPTDataset, split_documents
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.mock import MockGPTDataset
from megalite.data.remote_data import localize
from megalite.errors import DataError

SPLITS = ("train", "valid", "test")


def split_sample_counts(config: Config) -> tuple[int, int, int]:
    t = config.training
    evaluations = t.train_iters // t.eval_interval + 1
    g = t.global_batch_size
    return t.train_iters * g, evaluations * t.eval_iters * g, t.eval_iters * g


def build_datasets(config: Config, eod: int | None, is_builder: bool, barrier):
    """[train, valid, test]; a split with no documents (weight 0 in --split) is None.

    `is_builder` (global rank 0) builds and caches the sample indices while every other
    rank waits in `barrier` and then loads them.
    """
    counts = split_sample_counts(config)
    data, seed = config.data, config.training.seed
    documents = document_source(config)
    if data.mock_data:
        return [MockGPTDataset(max(n, 1), config.model.seq_length, config.model.vocab_size,
                               seed + i, documents)
                for i, n in enumerate(counts)]
    weights, named = parse_data_path(data.data_path)
    prefixes = localize(named, data.object_storage_cache_path, barrier)  # s3:// ones cached
    indexed = [open_indexed_dataset(p) for p in prefixes]
    if is_builder:
        for prefix, ds in zip(prefixes, indexed):
            check_token_ids(prefix, ds, config.model.vocab_size)
    return [_build_split(split, n, weights, prefixes, indexed, data, config.model.seq_length,
                         seed, eod, documents, is_builder, barrier)
            for split, n in zip(range(3), counts)]


def document_source(config: Config) -> str | None:
    """Where each sample's document starts come from (gpt_dataset.GPTDataset's
    `documents`): the index with --dataloader-inter-document-masking, the end-of-document
    tokens with --reset-attention-mask or --reset-position-ids, else nowhere."""
    model = config.model
    if model.dataloader_inter_document_masking:
        return "index"
    return "eod" if model.uses_documents else None


def open_indexed_dataset(prefix: str) -> IndexedDataset:
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            raise DataError(f"--data-path {prefix}: {prefix + suffix} not found")
    return IndexedDataset(prefix)


def check_token_ids(prefix: str, ds: IndexedDataset, vocab_size: int):
    """A token id beyond the tokenizer's vocabulary would index past the embedding table,
    or into its padding rows, whose logits are masked to -inf (an infinite loss at the
    first step); read every token once up front instead. Skipped when the file's dtype
    cannot hold such an id."""
    if ds.dtype.kind == "u" and np.iinfo(ds.dtype).max < vocab_size:
        return
    chunk = 1 << 26
    for start in range(0, len(ds.tokens), chunk):
        block = ds.tokens[start:start + chunk]
        top, bottom = int(block.max()), int(block.min())
        if top >= vocab_size or bottom < 0:
            raise DataError(f"--data-path {prefix}: token id "
                            f"{top if top >= vocab_size else bottom} is outside the "
                            f"tokenizer's vocabulary [0, {vocab_size}); was it "
                            "preprocessed with another tokenizer?")


def _build_split(split: int, num_samples: int, weights, prefixes, indexed, data: DataConfig,
                 seq_length: int, seed: int, eod, documents, is_builder: bool, barrier):
    if num_samples == 0:
        return None
    per_dataset = (component_num_samples(num_samples, weights) if len(prefixes) > 1
                   else [num_samples])
    parts = []
    for prefix, ds, n in zip(prefixes, indexed, per_dataset):
        start, end = split_documents(len(ds), data.split)[split]
        if start == end and split == 0:  # evaluation may go without; training may not
            why = (f"--split {data.split} gives the training set none of its {len(ds)} "
                   "documents" if len(ds) else "it holds none (preprocessed from an empty "
                   "input?)")
            raise DataError(f"--data-path {prefix}: no documents to train on: {why}")
        if start == end:
            return None
        parts.append(GPTDataset(
            ds, np.arange(start, end), n, seq_length, seed,
            name=f"{prefix}/{SPLITS[split]}", eod_token=eod, eod_mask_loss=data.eod_mask_loss,
            documents=documents, cache_dir=_cache_dir(data, prefix), is_builder=is_builder,
            barrier=barrier))
    if len(parts) == 1:
        return parts[0]
    return BlendedDataset(parts, weights, num_samples, cache_dir=_cache_dir(data, prefixes[0]),
                          is_builder=is_builder, barrier=barrier)


def _cache_dir(data: DataConfig, prefix: str) -> str:
    """--data-cache-path, or Megatron's default: a cache folder beside the data."""
    return data.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)),
                                                "cache", "GPTDataset_indices")
