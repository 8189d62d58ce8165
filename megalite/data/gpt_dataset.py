"""GPT pretraining samples cut from an indexed dataset (docs/design.md §7), Megatron-core style.

The documents of one split are repeated for as many epochs as `num_samples` needs, their
order shuffled, and the resulting token stream cut into samples of `seq_length + 1` tokens
(consecutive samples share one token: the last label of one is the first input of the next).
Three indices describe that, all built with NumPy and cached as .npy:

- document index: the shuffled document order, one entry per (epoch, document);
- sample index:   row i = (position in the document index, token offset) where sample i starts;
- shuffle index:  the order in which samples are served.

The indices follow Megatron-core's `GPTDataset` (legacy `np.random.RandomState(seed)`, the
same shuffles in the same order, the same sample cutting, its "separate final epoch" rule),
so for the same documents, seed and sizes they come out identical to Megatron's. Here the
sample index is computed by a vectorised search over document end offsets instead of
Megatron's C++ loop.

A "document" here is one sequence of the indexed dataset, as in Megatron's GPT dataset
(which is split by sequence): preprocess_data writes one sequence per non-empty document.
"""

import hashlib
import json
import logging
import os
import re
import time
from typing import Callable, Sequence

import numpy as np
import torch

from megalite.atomic_write import atomic_write
from megalite.documents import starts_from_eod, starts_from_lengths
from megalite.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# Bump when anything changes how the indices are computed: old cache files stop matching.
INDEX_FORMAT_VERSION = 1

# Megatron-core: when the last epoch would supply fewer than this fraction of an epoch's
# samples, it is shuffled on its own so its few documents are not spread over the whole run.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80

# Documents per chunk when building the sample index: bounds the temporary int64 arrays.
_SAMPLE_INDEX_CHUNK = 1 << 22


# --- --split ---

def parse_split(split: str) -> list[float]:
    """`--split "969,30,1"` (or "98/2/0", or "100") -> three weights normalised to sum 1."""
    text = split.strip() if isinstance(split, str) else ""
    parts = re.split(r"[,/]", text) if text else []
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = None
    if not weights or len(weights) > 3:
        raise ConfigError(f"--split {split!r}: expected up to three comma-separated numbers "
                          f"(train,valid,test), e.g. 969,30,1")
    weights += [0.0] * (3 - len(weights))
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {split!r}: weights must be finite, >= 0 and not all "
                          f"zero, got {weights}")
    total = sum(weights)
    return [w / total for w in weights]


def split_documents(num_documents: int, split: str = "969,30,1") -> list[tuple[int, int]]:
    """The (start, end) document ranges of train, valid and test.

    Megatron's rule (`_get_split_indices`, legacy `get_train_valid_test_split_`): each
    normalised weight times the count is rounded, the bounds are the running sum, and all
    bounds but the first are shifted by the rounding excess so the last one is exactly
    `num_documents`.
    """
    bounds = [0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [0] + [b - excess for b in bounds[1:]]
    return list(zip(bounds, bounds[1:]))


# --- Index cache: built once by the builder rank, read by everyone ---

def description_hash(description: dict) -> str:
    """sha256 of the canonical JSON of everything that determines a set of indices."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def array_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def build_or_load_indices(description: dict, names: Sequence[str],
                          build: Callable[[], dict[str, np.ndarray]], cache_dir: str | None,
                          is_builder: bool, barrier: Callable[[], None]) -> dict[str, np.ndarray]:
    """Return the arrays `names` for `description`.

    With no `cache_dir` every process builds in memory. Otherwise the builder builds on a
    cache miss and writes `<hash>-<name>.npy` (each through a temp name, the description
    JSON last, so its presence means the set is complete); then every process passes
    `barrier` exactly once, and the others load what the builder wrote.
    """
    if cache_dir is None:
        return build()

    prefix = os.path.join(cache_dir, f"{description_hash(description)}-{description['class']}")
    paths = {name: f"{prefix}-{name}.npy" for name in names}
    description_path = f"{prefix}-description.json"
    files = [description_path, *paths.values()]
    arrays = None
    if is_builder and not all(map(os.path.isfile, files)):
        t0 = time.perf_counter()
        arrays = build()
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in paths.items():
            atomic_write(path, lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False),
                         suffix=f".tmp-{os.getpid()}")
        text = json.dumps(description, sort_keys=True, indent=1).encode("utf-8")
        atomic_write(description_path, lambda f: f.write(text), suffix=f".tmp-{os.getpid()}")
        logger.info("built %s indices in %.2f s -> %s", description["class"],
                    time.perf_counter() - t0, prefix)
    barrier()
    if arrays is not None:
        return arrays
    if not all(map(os.path.isfile, files)):
        raise DataError(f"index cache {prefix}-*.npy is missing after the builder rank's "
                        f"turn: is the data cache directory {cache_dir!r} on a filesystem "
                        "every rank can see?")
    loaded = {}
    for name, path in paths.items():
        try:
            loaded[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read index cache file {path}: {err}; delete it to "
                            "rebuild") from err
    return loaded


# --- The three indices (pure functions of lengths, documents, sizes and seed) ---

def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Smallest number of epochs whose tokens give `num_samples` samples of seq_length+1."""
    tokens_needed = num_samples * seq_length + 1
    return max(1, -(-tokens_needed // tokens_per_epoch))


def build_document_index(document_ids, num_epochs, rng: np.random.RandomState,
                         separate_final_epoch: bool):
    """The split's documents repeated `num_epochs` times, shuffled together.

    With `separate_final_epoch` the first num_epochs-1 epochs are shuffled together and the
    last one on its own after them (Megatron's `_build_document_index`).
    """
    if separate_final_epoch and num_epochs > 1:
        return np.concatenate([build_document_index(document_ids, num_epochs - 1, rng, False),
                               build_document_index(document_ids, 1, rng, False)])
    dtype = np.int32 if int(np.max(document_ids)) < 2**31 else np.int64
    document_index = np.tile(np.asarray(document_ids, dtype=dtype), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(sequence_lengths, document_index, seq_length, num_samples_total):
    """Row i = (position in document_index, token offset) of token i*seq_length of the stream.

    The stream is the documents of `document_index` back to back. Sample i spans stream
    tokens [i*seq_length, (i+1)*seq_length], so it starts where row i says and ends where
    row i+1 says (inclusive). Same values as Megatron's `build_sample_idx` (C++), computed
    chunk by chunk with a binary search over each chunk's document end offsets.
    """
    dtype = np.int32 if len(document_index) < 2**31 else np.int64
    sample_index = np.empty((num_samples_total + 1, 2), dtype=dtype)
    first = 0          # first sample start not yet placed
    stream_end = 0     # tokens in all chunks before this one
    for chunk_start in range(0, len(document_index), _SAMPLE_INDEX_CHUNK):
        if first > num_samples_total:
            break
        chunk = document_index[chunk_start:chunk_start + _SAMPLE_INDEX_CHUNK]
        lengths = sequence_lengths[chunk].astype(np.int64)
        ends = np.cumsum(lengths)
        ends += stream_end
        stream_end = int(ends[-1])
        # Sample starts i*seq_length that fall before this chunk's end.
        last = min(num_samples_total + 1, -(-stream_end // seq_length))
        starts = np.arange(first, last, dtype=np.int64) * seq_length
        doc = np.searchsorted(ends, starts, side="right")  # first document ending after start
        sample_index[first:last, 0] = chunk_start + doc
        sample_index[first:last, 1] = starts - (ends[doc] - lengths[doc])
        first = last
    if first != num_samples_total + 1:
        raise RuntimeError("internal: the document index holds fewer tokens than its samples")
    return sample_index


def build_shuffle_index(num_samples_first, num_samples_total, rng: np.random.RandomState):
    """A permutation of range(total); with a separate final epoch, [0, first) and
    [first, total) are each shuffled in place (Megatron's `_build_shuffle_index`)."""
    dtype = np.uint32 if num_samples_total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples_first, dtype=dtype)
    rng.shuffle(first)
    if num_samples_first == num_samples_total:
        return first
    last = np.arange(num_samples_first, num_samples_total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(sequence_lengths, document_ids, num_samples, seq_length, seed):
    """The document, sample and shuffle indices (see the module docstring)."""
    tokens_per_epoch = int(np.sum(sequence_lengths[document_ids], dtype=np.int64))
    num_epochs = (1 if num_samples is None  # one epoch, as Megatron
                  else num_epochs_needed(tokens_per_epoch, num_samples, seq_length))
    # Megatron-core's separate final epoch, for when it supplies few of the samples.
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate = num_epochs > 1 and (num_samples - samples_before_final
                                   < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch))
    rng = np.random.RandomState(seed)
    document_index = build_document_index(document_ids, num_epochs, rng, separate)
    num_samples_total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(
        sequence_lengths, document_index, seq_length, num_samples_total)
    shuffle_first = samples_before_final if separate else num_samples_total
    shuffle_index = build_shuffle_index(shuffle_first, num_samples_total, rng)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


# --- The dataset ---

class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length` input tokens from documents `document_ids` of an indexed dataset.

    Args:
        indexed_dataset: has `sequence_lengths` (int32[N]) and `get(idx, offset, length)`.
        document_ids: the split's sequence indices, e.g. `np.arange(*split_documents(...)[0])`.
        num_samples: samples wanted (the dataset may hold a few more: whole epochs are cut);
            None for one epoch.
        seq_length: input tokens per sample (`--seq-length`); each sample reads seq_length+1.
        seed: `--seed`; fixes the document and sample order.
        name: what the data is (the path prefix, the split); part of the cache key.
        eod_token, eod_mask_loss: `--eod-mask-loss`: zero the loss where the input is eod.
        documents: each sample's "document_starts" (megalite/documents.py) from its
            end-of-document tokens ("eod"), from the document index ("index",
            --dataloader-inter-document-masking), or none (None).
        cache_dir: `--data-cache-path`; None builds in memory on every process.
        is_builder: whether this process builds and writes the cache (e.g. global rank 0).
        barrier: called exactly once by every process when `cache_dir` is set, after the
            builder has written; e.g. `torch.distributed.barrier`.
    """

    def __init__(self, indexed_dataset, document_ids, num_samples: int | None,
                 seq_length: int, seed: int, *, name: str = "",
                 eod_token: int | None = None, eod_mask_loss: bool = False,
                 documents: str | None = None,
                 cache_dir: str | None = None, is_builder: bool = True,
                 barrier: Callable[[], None] = lambda: None):
        if seq_length < 1:
            raise ConfigError(f"--seq-length must be >= 1, got {seq_length}")
        if num_samples is not None and num_samples < 0:
            raise ConfigError(f"{name}: number of samples must be >= 0, got {num_samples}")
        if eod_mask_loss and eod_token is None:
            raise ConfigError("--eod-mask-loss needs the tokenizer's eod id")
        if documents == "eod" and eod_token is None:
            raise ConfigError("--reset-attention-mask and --reset-position-ids need the "
                              "tokenizer's end-of-document token, and it has none; "
                              "--dataloader-inter-document-masking takes the documents from "
                              "the dataset's index instead")
        self.documents = documents
        lengths = indexed_dataset.sequence_lengths
        document_ids = np.asarray(document_ids)
        if document_ids.ndim != 1 or document_ids.size == 0:
            raise DataError(f"{name}: the split holds no documents (check --split)")
        if not np.issubdtype(document_ids.dtype, np.integer) or \
                document_ids.min() < 0 or document_ids.max() >= len(lengths):
            raise DataError(f"{name}: document ids must be integers in [0, {len(lengths)})")
        if int(np.sum(lengths[document_ids], dtype=np.int64)) == 0:
            raise DataError(f"{name}: the split's {document_ids.size} documents hold no tokens")

        self.indexed_dataset, self.seq_length = indexed_dataset, seq_length
        self.eod_token, self.eod_mask_loss = eod_token, eod_mask_loss
        self.description = {
            "class": "GPTDataset", "format_version": INDEX_FORMAT_VERSION, "name": name,
            "dataset_num_sequences": int(len(lengths)),
            "dataset_num_tokens": int(np.sum(lengths, dtype=np.int64)),
            "dataset_lengths_sha256": array_digest(np.asarray(lengths, dtype=np.int32)),
            "num_documents": int(document_ids.size),
            "document_ids_sha256": array_digest(document_ids.astype(np.int64)),
            "num_samples": num_samples, "seq_length": seq_length, "seed": seed}
        self.description_hash = description_hash(self.description)
        arrays = build_or_load_indices(
            self.description, ["document_index", "sample_index", "shuffle_index"],
            lambda: build_gpt_indices(lengths, document_ids, num_samples, seq_length, seed),
            cache_dir, is_builder, barrier)
        self.document_index, self.sample_index, self.shuffle_index = (
            arrays[n] for n in ("document_index", "sample_index", "shuffle_index"))

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_parts(self, sample: int) -> list[np.ndarray]:
        """The tokens of sample `sample`, one array per document it touches."""
        doc_begin, offset_begin = (int(x) for x in self.sample_index[sample])
        doc_end, offset_end = (int(x) for x in self.sample_index[sample + 1])
        parts = [self.indexed_dataset.get(int(self.document_index[d]))
                 for d in range(doc_begin, doc_end + 1)]
        parts[-1] = parts[-1][:offset_end + 1]  # the last first: it may be the first as well
        parts[0] = parts[0][offset_begin:]
        return parts

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        parts = self.sample_parts(int(self.shuffle_index[idx]))
        text = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod_token] = 0.0
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        if self.documents == "eod":
            sample["document_starts"] = starts_from_eod(tokens, self.eod_token)
        elif self.documents == "index":
            sample["document_starts"] = starts_from_lengths([len(p) for p in parts],
                                                            self.seq_length)
        return sample
