"""GPTDataset and --split, each checked against an independent reference: the token stream
built directly from the documents, Megatron's algorithms transcribed loop by loop, formulas."""

import os

import numpy as np
import pytest
import torch

from megalite.data.gpt_dataset import GPTDataset, parse_split, split_documents
from megalite.errors import ConfigError, DataError

EOD = 0


class TinyIndexedDataset:
    """Stand-in with the reader's interface: one sequence per document, eod-terminated."""

    def __init__(self, num_documents=40, seed=0, max_length=30):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, max_length, size=num_documents)
        self.sequences = [
            np.append(rng.integers(1, 1000, size=n - 1), EOD).astype(np.uint16) for n in lengths
        ]
        self.sequence_lengths = lengths.astype(np.int32)
        self.sequence_pointers = (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2).astype(np.int64)
        self.document_indices = np.arange(num_documents + 1, dtype=np.int64)

    def __len__(self):
        return len(self.sequences)

    def get(self, idx, offset=0, length=None):
        seq = self.sequences[idx]
        end = len(seq) if length is None else offset + length
        return seq[offset:end]


def megatron_epochs(tokens_per_epoch, num_samples, seq_length):
    """Megatron-core's `_get_num_epochs` loop and its separate-final-epoch rule."""
    epochs, tokens = 1, tokens_per_epoch
    while tokens < num_samples * seq_length + 1:
        epochs, tokens = epochs + 1, tokens + tokens_per_epoch
    if epochs == 1:
        return epochs, False, 0
    before = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return epochs, num_samples - before < int(0.80 * per_epoch), before


def megatron_order(document_ids, num_epochs, seed, separate, before=0, total=0):
    """Megatron-core's document index and shuffle index: one RandomState, in that order."""
    rng = np.random.RandomState(seed)
    ids = np.asarray(document_ids, dtype=np.int32)
    if separate:
        first, last = np.tile(ids, num_epochs - 1), ids.copy()
        rng.shuffle(first)
        rng.shuffle(last)
        documents = np.concatenate([first, last])
    else:
        documents = np.tile(ids, num_epochs)
        rng.shuffle(documents)
    cut = before if separate else total
    shuffle_first, shuffle_last = np.arange(cut, dtype=np.uint32), np.arange(cut, total, dtype=np.uint32)
    rng.shuffle(shuffle_first)
    if separate:
        rng.shuffle(shuffle_last)
    return documents, np.concatenate([shuffle_first, shuffle_last])


def megatron_build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's C++ `build_sample_idx`, transcribed loop for loop."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_idx_index, doc_offset = 0, 0
    for sample_index in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
    return sample_idx


def unshuffled_samples(ds):
    """The dataset's samples in sample-index (stream) order, via the public shuffle index."""
    position = np.empty(len(ds), dtype=np.int64)
    position[np.asarray(ds.shuffle_index, dtype=np.int64)] = np.arange(len(ds))
    return [ds[int(p)] for p in position]


# ---------------------------------------------------------------------------------- split

def megatron_get_split_indices(split, num_elements):
    """Megatron's `_get_split_indices` / legacy `get_train_valid_test_split_`, transcribed."""
    splits = [float(s) for s in split.split(",")]
    splits += [0.0] * (3 - len(splits))
    splits = [s / sum(splits) for s in splits]
    indices = [0]
    for s in splits:
        indices.append(indices[-1] + int(round(s * float(num_elements))))
    diff = indices[-1] - num_elements
    return [indices[0]] + [i - diff for i in indices[1:]]


@pytest.mark.parametrize("split,num_docs,expected", [
    ("969,30,1", 1000, [0, 969, 999, 1000]),
    ("1,1,1", 10, [0, 4, 7, 10]),          # round(3.33)=3 each -> sum 9 -> all shifted by +1
    ("2,1,1", 3, [0, 1, 2, 3]),            # round(1.5)=2 (banker's), round(.75)=1 x2 -> 4 -> -1
    ("98,2,0", 50, [0, 49, 50, 50]),
    ("100", 7, [0, 7, 7, 7]),
    ("90,10", 21, [0, 19, 21, 21]),        # round(18.9)=19, round(2.1)=2
])
def test_split_matches_megatron_worked_examples(split, num_docs, expected):
    got = split_documents(num_docs, split)
    assert [got[0][0]] + [end for _, end in got] == expected
    assert megatron_get_split_indices(split, num_docs) == expected


def test_split_matches_megatron_on_a_sweep():
    for split in ["969,30,1", "1,1,1", "7,2,1", "99,1,0", "0.5,0.25,0.25", "3,3", "1,0,1"]:
        for num_docs in [1, 2, 3, 5, 10, 17, 101, 1000, 12345]:
            got = split_documents(num_docs, split)
            bounds = [got[0][0]] + [end for _, end in got]
            assert bounds == megatron_get_split_indices(split, num_docs), (split, num_docs)
            assert all(start <= end for start, end in got)


def test_split_accepts_slashes_and_normalises():
    assert split_documents(100, "98/2/0") == split_documents(100, "98,2,0")
    assert parse_split("2,1,1") == [0.5, 0.25, 0.25]


@pytest.mark.parametrize("bad", ["", "a,b,c", "1,2,3,4", "-1,1,0", "0,0,0", "1,,2", "nan,1,1"])
def test_malformed_split_names_the_flag(bad):
    with pytest.raises(ConfigError, match="--split"):
        split_documents(100, bad)


# ---------------------------------------------------------------------------------- stream

def test_samples_reproduce_the_shuffled_document_stream():
    data = TinyIndexedDataset(num_documents=40)
    train, _, _ = split_documents(len(data), "8,1,1")
    doc_ids = np.arange(*train)
    seq_length, num_samples, seed = 16, 60, 1234
    ds = GPTDataset(data, doc_ids, num_samples, seq_length, seed, name="tiny")

    tokens_per_epoch = int(data.sequence_lengths[doc_ids].sum())
    num_epochs, separate, _ = megatron_epochs(tokens_per_epoch, num_samples, seq_length)
    assert num_epochs > 1  # the test must cross an epoch boundary
    order, _ = megatron_order(doc_ids, num_epochs, seed, separate)
    stream = np.concatenate([data.sequences[d] for d in order]).astype(np.int64)

    assert len(ds) == (num_epochs * tokens_per_epoch - 1) // seq_length >= num_samples
    samples = unshuffled_samples(ds)
    pieces = [samples[0]["tokens"].numpy()]
    for i, s in enumerate(samples):
        assert s["tokens"].shape == (seq_length,) and s["labels"].shape == (seq_length,)
        np.testing.assert_array_equal(s["labels"][:-1], s["tokens"][1:])
        if i + 1 < len(samples):  # consecutive samples share one token
            assert samples[i + 1]["tokens"][0] == s["labels"][-1]
        pieces.append(s["labels"].numpy()[-seq_length:] if i else s["labels"].numpy()[-1:])
    joined = np.concatenate(pieces)
    np.testing.assert_array_equal(joined, stream[: len(joined)])
    assert len(joined) == len(ds) * seq_length + 1


def test_indices_match_megatron_algorithms():
    data = TinyIndexedDataset(num_documents=25, seed=3)
    doc_ids = np.arange(3, 25)
    tpe = int(data.sequence_lengths[doc_ids].sum())
    seen_separate = set()
    for seq_length, num_samples in [(7, 10), (7, 200), (7, 140), (31, 3), (1, 50), (5, 0)]:
        ds = GPTDataset(data, doc_ids, num_samples, seq_length, seed=5)
        epochs, separate, before = megatron_epochs(tpe, num_samples, seq_length)
        total = (epochs * tpe - 1) // seq_length
        seen_separate.add(separate)
        documents, shuffle = megatron_order(doc_ids, epochs, 5, separate, before, total)
        np.testing.assert_array_equal(ds.document_index, documents)
        np.testing.assert_array_equal(ds.shuffle_index, shuffle)
        assert ds.shuffle_index.dtype == np.uint32 and ds.document_index.dtype == np.int32
        np.testing.assert_array_equal(
            ds.sample_index, megatron_build_sample_idx(data.sequence_lengths, documents, seq_length, epochs, tpe)
        )
    assert seen_separate == {True, False}


def test_separate_final_epoch_keeps_last_epoch_samples_last():
    data = TinyIndexedDataset(num_documents=30, seed=7)
    tpe = int(data.sequence_lengths.sum())
    seq_length = 8
    num_samples = 2 * ((tpe - 1) // seq_length) + 2  # a tiny third epoch -> shuffled apart
    ds = GPTDataset(data, np.arange(30), num_samples, seq_length, seed=11)
    before = (2 * tpe - 1) // seq_length
    # The first two epochs' documents come first, then one whole third epoch.
    assert sorted(ds.document_index[-30:].tolist()) == list(range(30))
    assert sorted(np.asarray(ds.shuffle_index[:before]).tolist()) == list(range(before))
    assert sorted(np.asarray(ds.shuffle_index[before:]).tolist()) == list(range(before, len(ds)))


def test_same_seed_same_order_different_seed_different_order():
    data = TinyIndexedDataset(num_documents=40)
    a = GPTDataset(data, np.arange(40), 50, 10, seed=1)
    b = GPTDataset(data, np.arange(40), 50, 10, seed=1)
    c = GPTDataset(data, np.arange(40), 50, 10, seed=2)
    for name in ["document_index", "sample_index", "shuffle_index"]:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert all(np.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert any(not np.array_equal(a[i]["tokens"], c[i]["tokens"]) for i in range(len(a)))


def test_one_epoch_when_num_samples_is_none():
    data = TinyIndexedDataset(num_documents=20)
    ds = GPTDataset(data, np.arange(20), None, 12, seed=0)
    assert len(ds.document_index) == 20
    assert len(ds) == (int(data.sequence_lengths.sum()) - 1) // 12


def test_eod_mask_loss_masks_positions_whose_input_is_eod():
    data = TinyIndexedDataset(num_documents=20)
    ds = GPTDataset(data, np.arange(20), 30, 16, seed=0, eod_token=EOD, eod_mask_loss=True)
    plain = GPTDataset(data, np.arange(20), 30, 16, seed=0)
    saw_eod = False
    for i in range(len(ds)):
        s = ds[i]
        expected = (s["tokens"] != EOD).float()
        assert s["loss_mask"].dtype == torch.float32
        assert s["tokens"].dtype == s["labels"].dtype == torch.int64
        np.testing.assert_array_equal(s["loss_mask"], expected)
        saw_eod |= bool((s["tokens"] == EOD).any())
        np.testing.assert_array_equal(plain[i]["loss_mask"], np.ones(16, dtype=np.float32))
    assert saw_eod


def test_out_of_range_index_raises_index_error():
    ds = GPTDataset(TinyIndexedDataset(10), np.arange(10), 5, 8, seed=0)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_bad_inputs_are_typed_errors():
    data = TinyIndexedDataset(10)
    with pytest.raises(DataError, match="no documents"):
        GPTDataset(data, np.arange(0), 5, 8, seed=0, name="x")
    with pytest.raises(DataError, match=r"\[0, 10\)"):
        GPTDataset(data, np.arange(5, 11), 5, 8, seed=0)
    with pytest.raises(ConfigError, match="--eod-mask-loss"):
        GPTDataset(data, np.arange(10), 5, 8, seed=0, eod_mask_loss=True)
    with pytest.raises(ConfigError, match="--seq-length"):
        GPTDataset(data, np.arange(10), 5, 0, seed=0)


# ---------------------------------------------------------------------------------- cache

def _files(d):
    return sorted(os.listdir(d))


def test_cache_hit_returns_identical_arrays(tmp_path):
    data = TinyIndexedDataset(30)
    calls = []
    built = GPTDataset(data, np.arange(30), 40, 8, seed=3, name="tiny/train",
                       cache_dir=str(tmp_path), barrier=lambda: calls.append("b"))
    files = _files(tmp_path)
    assert len(files) == 4 and all(f.startswith(built.description_hash) for f in files)
    assert not any(".tmp" in f for f in files)
    # A non-builder rank reads what the builder wrote (after its barrier).
    loaded = GPTDataset(data, np.arange(30), 40, 8, seed=3, name="tiny/train",
                        cache_dir=str(tmp_path), is_builder=False, barrier=lambda: calls.append("b"))
    assert calls == ["b", "b"]
    assert isinstance(loaded.document_index, np.memmap)
    for name in ["document_index", "sample_index", "shuffle_index"]:
        a, b = getattr(built, name), getattr(loaded, name)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert _files(tmp_path) == files
    np.testing.assert_array_equal(built[7]["tokens"], loaded[7]["tokens"])


def test_cache_is_reused_not_rebuilt(tmp_path, monkeypatch):
    data = TinyIndexedDataset(30)
    GPTDataset(data, np.arange(30), 40, 8, seed=3, cache_dir=str(tmp_path))
    import megalite.data.gpt_dataset as gpt_dataset

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt on a cache hit")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", fail)
    GPTDataset(data, np.arange(30), 40, 8, seed=3, cache_dir=str(tmp_path))


@pytest.mark.parametrize("change", [
    dict(seed=4), dict(seq_length=9), dict(num_samples=41), dict(document_ids=np.arange(29)),
    dict(name="other/train"), dict(data=TinyIndexedDataset(30, seed=1)),
])
def test_changed_parameter_changes_the_cache_name(tmp_path, change):
    base = dict(data=TinyIndexedDataset(30), document_ids=np.arange(30), num_samples=40,
                seq_length=8, seed=3, name="tiny/train")
    first = GPTDataset(base["data"], base["document_ids"], base["num_samples"],
                       base["seq_length"], base["seed"], name=base["name"], cache_dir=str(tmp_path))
    args = {**base, **change}
    second = GPTDataset(args["data"], args["document_ids"], args["num_samples"],
                        args["seq_length"], args["seed"], name=args["name"], cache_dir=str(tmp_path))
    assert first.description_hash != second.description_hash
    assert len(_files(tmp_path)) == 8


def test_non_builder_without_cache_files_names_the_cache_dir(tmp_path):
    with pytest.raises(DataError, match="every rank"):
        GPTDataset(TinyIndexedDataset(10), np.arange(10), 5, 8, seed=0,
                   cache_dir=str(tmp_path / "cache"), is_builder=False)


# ---------------------------------------------------------------------------------- real reader

def test_with_the_real_indexed_dataset(tmp_path):
    indexed = pytest.importorskip("megalite.data.indexed_dataset")
    tiny = TinyIndexedDataset(num_documents=30, seed=9)
    prefix = str(tmp_path / "corpus_text_document")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", np.uint16, vocab_size=1000)
    for seq in tiny.sequences:
        builder.add_document(seq)
    builder.finalize(prefix + ".idx")
    real = indexed.IndexedDataset(prefix)

    train, _, _ = split_documents(len(real), "90,10,0")
    doc_ids = np.arange(*train)
    on_disk = GPTDataset(real, doc_ids, 45, 12, seed=2, name=prefix, eod_token=EOD, eod_mask_loss=True,
                         cache_dir=str(tmp_path / "cache"))
    in_memory = GPTDataset(tiny, doc_ids, 45, 12, seed=2, name=prefix, eod_token=EOD, eod_mask_loss=True)
    assert on_disk.description_hash == in_memory.description_hash  # same lengths, same name
    for i in range(len(on_disk)):
        for key in ("tokens", "labels", "loss_mask"):
            np.testing.assert_array_equal(on_disk[i][key], in_memory[i][key])
