"""Checkpoint storage: layout, crash safety, tracker and metadata errors, retention, safety.

Expectations are written out independently of the code: directory names and tracker bytes as
Megatron writes them, metadata read back with the plain `json` module, tensors compared with
what was saved, and the malicious pickle proven live by loading it unsafely afterwards.
"""

import json
import os
import pathlib

import pytest
import torch

from megalite.checkpointing import storage as cs
from megalite.checkpointing.model_fields import check_model_compatible
from megalite.checkpointing.saving import model_fields
from megalite.errors import CheckpointError, MegaliteError

from tests.helpers import tiny_gpt_config

SHARDS = ["model_tp0_pp0.pt", "optim_dp0.pt"]


def save_checkpoint(save, iteration, value=None, files=SHARDS, metadata=None):
    """What a training run does: stage, every 'rank' writes its shard, rank 0 commits."""
    staging = cs.prepare_staging(save, iteration)
    for name in files:
        cs.save_tensor_file({"w": torch.full((3,), float(value or iteration))}, staging / name)
    return cs.commit(save, iteration, metadata or {"consumed_samples": 8 * iteration}, files)


def test_round_trip_layout_and_metadata(tmp_path):
    final = save_checkpoint(tmp_path, 100, metadata={"consumed_samples": 800, "tp": 1})

    assert final == tmp_path / "iter_0000100"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000100", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_bytes() == b"100"
    assert sorted(p.name for p in final.iterdir()) == sorted(SHARDS + ["metadata.json"])
    on_disk = json.loads((final / "metadata.json").read_text())
    assert on_disk.pop("checksum").startswith("crc32:")
    assert on_disk == {"consumed_samples": 800, "tp": 1, "iteration": 100, "files": SHARDS}

    assert cs.find_checkpoint_to_load(tmp_path) == (100, final)
    assert cs.read_metadata(final) == on_disk
    loaded = cs.load_tensor_file(final / SHARDS[0])
    assert torch.equal(loaded["w"], torch.tensor([100.0, 100.0, 100.0]))


def test_staging_dir_is_deterministic_and_prepare_clears_a_stale_one(tmp_path):
    assert cs.staging_dir(tmp_path, 100) == cs.staging_dir(str(tmp_path), 100)
    stale = cs.staging_dir(tmp_path, 100)
    stale.mkdir()
    (stale / "shard_of_another_layout.pt").write_bytes(b"x")
    assert cs.prepare_staging(tmp_path, 100) == stale
    assert list(stale.iterdir()) == []


def test_crash_after_first_shard_keeps_previous_checkpoint(tmp_path):
    previous = save_checkpoint(tmp_path, 100)
    staging = cs.prepare_staging(tmp_path, 200)
    cs.save_tensor_file({"w": torch.zeros(3)}, staging / SHARDS[0])
    # the job dies here: no second shard, no commit
    assert cs.find_checkpoint_to_load(tmp_path) == (100, previous)


def test_commit_with_a_missing_shard_names_it_and_publishes_nothing(tmp_path):
    save_checkpoint(tmp_path, 100)
    staging = cs.prepare_staging(tmp_path, 200)
    cs.save_tensor_file({"w": torch.zeros(3)}, staging / SHARDS[0])
    with pytest.raises(CheckpointError, match="optim_dp0.pt"):
        cs.commit(tmp_path, 200, {}, SHARDS)
    assert not (tmp_path / "iter_0000200").exists()
    assert cs.find_checkpoint_to_load(tmp_path)[0] == 100


def test_crash_before_tracker_keeps_previous_checkpoint(tmp_path, monkeypatch):
    previous = save_checkpoint(tmp_path, 100)
    real_replace = os.replace

    def die_on_tracker(src, dst):
        if pathlib.Path(dst).name == cs.TRACKER_FILENAME:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", die_on_tracker)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 200)
    monkeypatch.undo()
    assert (tmp_path / "iter_0000200" / "metadata.json").is_file()
    assert cs.find_checkpoint_to_load(tmp_path) == (100, previous)


def test_tracker_is_replaced_last(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 100)
    moves = []

    def recording(real):
        def move(src, dst):
            moves.append((pathlib.Path(src).name, pathlib.Path(dst).name))
            real(src, dst)
        return move

    monkeypatch.setattr(os, "replace", recording(os.replace))
    monkeypatch.setattr(os, "rename", recording(os.rename))
    save_checkpoint(tmp_path, 200)
    assert moves[-1] == ("latest_checkpointed_iteration.txt.tmp",
                         "latest_checkpointed_iteration.txt")
    assert moves[-2] == ("iter_0000200.tmp", "iter_0000200")
    assert ("metadata.json.tmp", "metadata.json") in moves[:-2]


def test_resaving_an_iteration_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 100, value=1.0)
    save_checkpoint(tmp_path, 100, value=2.0, files=[SHARDS[0]])
    iteration, final = cs.find_checkpoint_to_load(tmp_path)
    assert iteration == 100
    assert sorted(p.name for p in final.iterdir()) == sorted([SHARDS[0], "metadata.json"])
    assert torch.equal(cs.load_tensor_file(final / SHARDS[0])["w"], torch.full((3,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000100", "latest_checkpointed_iteration.txt"]


def test_fresh_start(tmp_path):
    assert cs.find_checkpoint_to_load(tmp_path / "does_not_exist") is None
    assert cs.find_checkpoint_to_load(tmp_path) is None
    # a crash during the very first save leaves only a staging dir: still a fresh start
    cs.save_tensor_file({"w": torch.zeros(1)}, cs.prepare_staging(tmp_path, 100) / "a.pt")
    assert cs.find_checkpoint_to_load(tmp_path) is None


def test_missing_tracker_with_checkpoints_is_an_error(tmp_path):
    """With one checkpoint it is the one to resume from (the first save stopped before
    its tracker: test_checkpointing.py); with several the user chooses."""
    save_checkpoint(tmp_path, 100)
    save_checkpoint(tmp_path, 200)
    tracker = tmp_path / cs.TRACKER_FILENAME
    tracker.unlink()
    with pytest.raises(CheckpointError, match="iter_0000100', 'iter_0000200") as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(tracker) in str(info.value) and "missing" in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("", "empty"), ("  \n", "empty"), ("abc", "garbled"), ("-5", "garbled"),
    ("1e3", "garbled")])
def test_bad_tracker_is_an_error_naming_it(tmp_path, text, expected):
    save_checkpoint(tmp_path, 100)
    tracker = tmp_path / cs.TRACKER_FILENAME
    tracker.write_text(text)
    with pytest.raises(CheckpointError, match=expected) as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(tracker) in str(info.value)


def test_binary_tracker_is_an_error_naming_it(tmp_path):
    tracker = tmp_path / cs.TRACKER_FILENAME
    tracker.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match="unreadable") as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(tracker) in str(info.value)


def test_tracker_with_trailing_newline_is_accepted(tmp_path):
    final = save_checkpoint(tmp_path, 100)
    (tmp_path / cs.TRACKER_FILENAME).write_text("100\n")
    assert cs.find_checkpoint_to_load(tmp_path) == (100, final)


def test_tracker_naming_a_missing_directory(tmp_path):
    save_checkpoint(tmp_path, 100)
    (tmp_path / cs.TRACKER_FILENAME).write_text("300")
    with pytest.raises(CheckpointError, match="does not exist") as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(tmp_path / "iter_0000300") in str(info.value)


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    final = save_checkpoint(tmp_path, 100)
    metadata = final / "metadata.json"
    good = metadata.read_text()

    metadata.unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint") as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(final) in str(info.value)

    metadata.write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(metadata) in str(info.value)

    metadata.write_text(json.dumps({"iteration": 100, "files": ["../../etc/passwd"]}))
    with pytest.raises(CheckpointError, match="relative"):
        cs.read_metadata(final)

    metadata.write_text(good)
    (final / SHARDS[1]).unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint") as info:
        cs.find_checkpoint_to_load(tmp_path)
    assert str(final) in str(info.value) and SHARDS[1] in str(info.value)


def test_metadata_iteration_must_match_the_tracker(tmp_path):
    final = save_checkpoint(tmp_path, 100)
    final.rename(tmp_path / "iter_0000200")
    (tmp_path / cs.TRACKER_FILENAME).write_text("200")
    with pytest.raises(CheckpointError, match="records iteration 100"):
        cs.find_checkpoint_to_load(tmp_path)


def test_release_tracker_loads_the_release_directory(tmp_path):
    release = tmp_path / "release"
    cs.save_tensor_file({"w": torch.ones(2)}, release / "model.pt")
    (release / "metadata.json").write_text(json.dumps({"iteration": 0, "files": ["model.pt"]}))
    (tmp_path / cs.TRACKER_FILENAME).write_text("release")
    assert cs.find_checkpoint_to_load(tmp_path) == (0, release)


def test_retention_keeps_the_newest_n(tmp_path):
    for iteration in (100, 200, 300, 400, 500):
        save_checkpoint(tmp_path, iteration)
    deleted = cs.apply_retention(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["iter_0000100", "iter_0000200", "iter_0000300"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000400", "iter_0000500"]


def test_retention_never_deletes_the_tracked_checkpoint(tmp_path):
    for iteration in (100, 200, 300):
        save_checkpoint(tmp_path, iteration)
    (tmp_path / cs.TRACKER_FILENAME).write_text("100")  # a user rolled back to iteration 100
    cs.apply_retention(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000100", "iter_0000300"]
    assert cs.find_checkpoint_to_load(tmp_path)[0] == 100


def test_retention_keep_zero_keeps_all_and_leftovers_go(tmp_path):
    for iteration in (100, 200, 300):
        save_checkpoint(tmp_path, iteration)
    cs.prepare_staging(tmp_path, 50)     # crashed save before the tracked one
    cs.prepare_staging(tmp_path, 400)    # a save that may still be retried: kept
    (tmp_path / "iter_0000300.old").mkdir()  # crash between a re-save's rename and cleanup
    (tmp_path / "iter_0000250").mkdir()      # not ours to judge: incomplete, left alone
    cs.apply_retention(tmp_path, keep=0)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [
        "iter_0000100", "iter_0000200", "iter_0000250", "iter_0000300", "iter_0000400.tmp"]


class _Payload:
    """Unpickling this touches a marker file: a stand-in for arbitrary code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": _Payload(str(marker))}, path)

    with pytest.raises(CheckpointError, match="refused") as info:
        cs.load_tensor_file(path)
    assert str(path) in str(info.value)
    assert not marker.exists()

    torch.load(path, weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.exists()


def test_unreadable_and_missing_tensor_files(tmp_path):
    truncated = tmp_path / "truncated.pt"
    cs.save_tensor_file({"w": torch.ones(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        cs.load_tensor_file(truncated)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="unreadable"):
        cs.load_tensor_file(tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        cs.load_tensor_file(tmp_path / "absent.pt")


def test_save_tensor_file_leaves_no_temp_file(tmp_path):
    cs.save_tensor_file({"w": torch.ones(1)}, tmp_path / "a.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
             num_query_groups=4, kv_channels=16, vocab_size=50, max_position_embeddings=32,
             position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
             normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, padded_vocab_size=64)


def test_compatible_models_pass_despite_padding_and_epsilon():
    current = dict(MODEL, padded_vocab_size=128, norm_epsilon=1e-6)
    check_model_compatible(json.loads(json.dumps(MODEL)), current)


def test_incompatible_model_lists_every_field_with_both_values():
    current = dict(MODEL, num_layers=4, normalization="LayerNorm")
    with pytest.raises(CheckpointError) as info:
        check_model_compatible(MODEL, current, checkpoint="/ckpt/iter_0000100")
    message = str(info.value)
    assert "/ckpt/iter_0000100" in message
    assert "num_layers: checkpoint: 2, this run: 4" in message
    assert "normalization: checkpoint: 'RMSNorm', this run: 'LayerNorm'" in message
    assert "hidden_size" not in message
    assert isinstance(info.value, MegaliteError)


def test_a_field_missing_from_the_checkpoint_is_a_difference():
    saved = {k: v for k, v in MODEL.items() if k != "swiglu"}
    with pytest.raises(CheckpointError, match="swiglu: checkpoint: '<not recorded>'"):
        check_model_compatible(saved, MODEL)


def test_qk_layernorm_is_recorded_only_when_set():
    """A checkpoint from before --qk-layernorm (no such field) still matches a model without
    it; a model with it and one without are refused by name, either way round."""
    plain, qk = (model_fields(tiny_gpt_config(qk_layernorm=on)) for on in (False, True))
    assert "qk_layernorm" not in plain and qk["qk_layernorm"] is True
    check_model_compatible(plain, plain)
    for saved, current in ((plain, qk), (qk, plain)):
        with pytest.raises(CheckpointError, match="qk_layernorm: checkpoint"):
            check_model_compatible(saved, current)
