"""What a run may do to the checkpoints already in --save (issue #46, checkpointing/save_guard.py):
a --save holding checkpoints the run does not resume from, or one it cannot write, is refused
before start-up; with --overwrite-save, retention and the tracker leave the other run's
checkpoints alone, on the synchronous and the asynchronous save path.

The other run's checkpoints are written with storage.py's own steps (stage, write, commit);
what is left of them is compared byte for byte with what was there before."""

import json

import pytest

from megalite.checkpointing import saving, storage
from megalite.checkpointing.save_guard import check_save_directory
from megalite.config import CheckpointConfig
from megalite.errors import CheckpointError
from megalite.training import pretrain

from tests.helpers import flags_with

FLAGS = flags_with("--eval-iters", "0", "--num-workers", "0", hidden_size=32, seq_length=16,
                   micro_batch_size=2, global_batch_size=4, train_iters=2)
LAYOUT = saving.SINGLE_PROCESS_LAYOUT
FILES = saving.expected_files(LAYOUT, save_optim=False)


def publish(save, iteration: int, run_id: str, resumed_at=None, keep: int = 0):
    """A save of `iteration` by the launch `run_id` (saving.publish after every 'rank' wrote
    its file), keeping the newest `keep` of its checkpoints."""
    staging = storage.prepare_staging(save, iteration)
    for name in FILES:
        (staging / name).write_bytes(f"{run_id} {iteration} {name}".encode())
    metadata = {"layout": LAYOUT, "run": {"id": run_id, "resumed_at": resumed_at}}
    config = type("Config", (), {"checkpoint": CheckpointConfig(keep_last=keep,
                                                                 save_optim=False)})
    saving.publish(str(save), iteration, metadata, config)


def other_run(save) -> dict:
    """Iterations 2, 4 and 6 of another run, the tracker naming 6; returns its files."""
    for iteration in (2, 4, 6):
        publish(save, iteration, "other-run")
    return files(save)


def files(save) -> dict:
    return {str(p.relative_to(save)): p.read_bytes() for p in sorted(save.rglob("*"))
            if p.is_file()}


def run_of(save, iteration: int) -> str:
    return json.loads((save / f"iter_{iteration:07d}" / "metadata.json").read_text())["run"]["id"]


def test_a_save_holding_another_run_is_refused_before_start_up(tmp_path, capsys):
    save = tmp_path / "ckpt"
    before = other_run(save)
    assert pretrain([*FLAGS, "--save", str(save)]) == 2
    out, err = capsys.readouterr()
    assert f"error: --save {save} holds checkpoints this run does not resume from (its " \
           "tracker names iteration 6; checkpoint directories iter_0000002, iter_0000004, " \
           "iter_0000006; there is no --load)" in err, err
    assert f"pass --load {save}" in err and "pass --overwrite-save" in err, err
    assert "number of parameters" not in out  # refused before the model was built
    assert files(save) == before


@pytest.mark.parametrize("fields, refused", [
    ({}, "there is no --load"),
    ({"load": "elsewhere"}, "--load is elsewhere"),
    ({"load": "SAVE", "finetune": True}, "--finetune restarts at iteration 0"),
    ({"load": "SAVE"}, None),
    ({"load": "SAVE/."}, None),  # the same directory, spelt differently
    ({"overwrite_save": True}, None),
])
def test_which_runs_may_save_into_a_directory_holding_checkpoints(tmp_path, fields, refused):
    save = tmp_path / "ckpt"
    other_run(save)
    fields = {k: str(save) + v[4:] if isinstance(v, str) and v.startswith("SAVE") else v
              for k, v in fields.items()}
    ckpt = CheckpointConfig(save=str(save), **fields)
    if refused is None:
        check_save_directory(ckpt)
    else:
        with pytest.raises(CheckpointError, match=refused):
            check_save_directory(ckpt)


def test_a_fresh_or_leftover_only_save_is_accepted_and_created(tmp_path):
    check_save_directory(CheckpointConfig(save=str(tmp_path / "new" / "ckpt")))
    assert (tmp_path / "new" / "ckpt").is_dir()
    storage.prepare_staging(tmp_path / "crashed", 2)  # a first save that never finished
    check_save_directory(CheckpointConfig(save=str(tmp_path / "crashed")))


@pytest.mark.parametrize("below", ["", "ckpt"])
def test_a_save_that_is_a_file_is_refused_before_start_up(tmp_path, capsys, below):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    save = a_file / below if below else a_file
    assert pretrain([*FLAGS, "--save", str(save)]) == 2
    out, err = capsys.readouterr()
    assert f"error: --save {save}: {a_file} is a file, not a directory" in err, err
    assert "number of parameters" not in out


def test_retention_and_the_tracker_leave_another_runs_checkpoints_alone(tmp_path, capsys):
    save = tmp_path / "ckpt"
    before = other_run(save)
    publish(save, 2, "this-run", keep=1)  # replaces the other run's 2 (--overwrite-save)
    publish(save, 3, "this-run", keep=1)
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000003", "iter_0000004", "iter_0000006", storage.TRACKER_FILENAME]
    assert {k: v for k, v in files(save).items() if k.startswith(("iter_0000004/",
                                                                  "iter_0000006/"))} == \
        {k: v for k, v in before.items() if k.startswith(("iter_0000004/", "iter_0000006/"))}
    assert (save / storage.TRACKER_FILENAME).read_bytes() == b"6"
    assert run_of(save, 3) == "this-run"
    assert "the tracker of" in capsys.readouterr().out


def test_retention_counts_the_past_of_a_run_resumed_from_its_save(tmp_path):
    """A restart (--load = --save, resumed at 6): 2, 4 and 6 are the run's own, and go."""
    save = tmp_path / "ckpt"
    other_run(save)
    publish(save, 8, "next-launch", resumed_at=6, keep=1)
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000008", storage.TRACKER_FILENAME]
    assert (save / storage.TRACKER_FILENAME).read_bytes() == b"8"


@pytest.mark.parametrize("save_flags", [[], ["--async-save"]], ids=["sync", "async"])
def test_overwrite_save_replaces_only_what_it_saves(tmp_path, capsys, save_flags):
    save = tmp_path / "ckpt"
    before = other_run(save)
    assert pretrain([*FLAGS, "--save", str(save), "--overwrite-save", "--save-interval", "1",
                     "--keep-last-n-checkpoints", "1", *save_flags]) == 0
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000002", "iter_0000004", "iter_0000006", storage.TRACKER_FILENAME]
    kept = {k: v for k, v in before.items() if not k.startswith("iter_0000002/")}
    assert {k: v for k, v in files(save).items() if k in kept} == kept
    assert run_of(save, 2) != "other-run"
    assert "still names iteration 6" in capsys.readouterr().out
