"""Checkpoints in one process, end to end through pretrain_gpt.py: exact resume (in a new
process, with dropout), a crash in the middle of a save, retention, refused trackers,
models and pickles, signals and the exit duration (docs/design.md §8)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.arguments import parse_args
from megalite.checkpointing import saving
from megalite.checkpointing.storage import TRACKER_FILENAME, find_checkpoint_to_load
from megalite.memory_estimate.checkpoint import MEASURED_WRITE_GBPS, planned_save_seconds
from megalite.training import pretrain
from megalite.validation import validate_args

from tests.helpers import (assert_identical, checkpoint_tensors, flags_with,
                           flip_a_bit_of_the_largest_record, saved_files, scalars, tensor_bytes)

ROOT = Path(__file__).resolve().parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
                   "--num-workers", "0", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
                   vocab_size=61, make_vocab_size_divisible_by=None, hidden_size=32,
                   seq_length=16, micro_batch_size=2, global_batch_size=4, train_iters=6,
                   lr="3e-3")


def launch(*flags, **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "pretrain_gpt.py", *FLAGS, *flags], cwd=ROOT,
                            env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **popen)


def run_process(*flags) -> subprocess.CompletedProcess:
    proc = launch(*flags)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_resume_in_a_new_process_is_bit_exact(tmp_path):
    """6 steps straight against 3 steps + save + a new process + load + 3 steps, with
    dropout: every step's loss and grad norm, every parameter, optimizer tensor and RNG
    state at the end identical."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_process("--save", str(straight), "--tensorboard-dir", str(tmp_path / "tb1"))
    run_process("--save", str(resumed), "--exit-interval", "3",
                "--tensorboard-dir", str(tmp_path / "tb2"))
    out = run_process("--save", str(resumed), "--load", str(resumed),
                      "--tensorboard-dir", str(tmp_path / "tb3")).stdout
    assert "resuming from" in out and "at iteration 3" in out
    first, second, third = (scalars(tmp_path / d) for d in ("tb1", "tb2", "tb3"))
    for tag in first:
        assert sorted(second[tag]) == [1, 2, 3] and sorted(third[tag]) == [4, 5, 6]
        assert first[tag] == {**second[tag], **third[tag]}, tag
    assert_identical(checkpoint_tensors(straight), checkpoint_tensors(resumed))


def test_crash_after_the_first_shard_leaves_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                   capsys):
    save = tmp_path / "ckpt"
    writes = []
    original = saving.save_tensor_file

    def crash_on_second_save(obj, path):
        writes.append(Path(path))
        original(obj, path)
        if "iter_0000004" in str(path):
            raise RuntimeError("injected crash after the first shard")
    monkeypatch.setattr(saving, "save_tensor_file", crash_on_second_save)
    try:
        pretrain([*FLAGS, "--save", str(save), "--save-interval", "2"])
    except RuntimeError as error:
        assert "injected crash" in str(error)
    else:
        raise AssertionError("the injected crash did not happen")
    assert find_checkpoint_to_load(save)[0] == 2
    assert (save / "iter_0000004.tmp").is_dir() and not (save / "iter_0000004").exists()
    monkeypatch.setattr(saving, "save_tensor_file", original)
    capsys.readouterr()
    assert pretrain([*FLAGS, "--save", str(save), "--load", str(save)]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert find_checkpoint_to_load(save)[0] == 6


def test_retention_keeps_the_last_n(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--save", str(save), "--save-interval", "1",
                     "--keep-last-n-checkpoints", "2", "--eval-iters", "0"]) == 0
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000005", "iter_0000006", TRACKER_FILENAME]


def test_bad_trackers_are_errors_naming_the_path(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--save", str(save), "--train-iters", "2", "--eval-iters", "0"]) == 0
    tracker = save / TRACKER_FILENAME
    for text, message in (("", "empty"), ("two", ""), ("7", "iter_0000007")):
        tracker.write_text(text)
        capsys.readouterr()
        assert pretrain([*FLAGS, "--load", str(save)]) == 1
        err = capsys.readouterr().err
        assert str(tracker) in err or str(save) in err, err
        assert message in err
    tracker.write_text("2")
    (save / "iter_0000002" / "metadata.json").unlink()
    assert pretrain([*FLAGS, "--load", str(save)]) == 1
    assert "iter_0000002" in capsys.readouterr().err


def test_a_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--save", str(save), "--train-iters", "1", "--eval-iters", "0"]) == 0
    capsys.readouterr()
    other = [*FLAGS, "--load", str(save), "--hidden-size", "64", "--num-layers", "3"]
    assert pretrain(other) == 1
    err = capsys.readouterr().err
    assert "hidden_size: checkpoint: 32, this run: 64" in err
    assert "num_layers: checkpoint: 2, this run: 3" in err


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_malicious_pickle_is_refused_and_never_run(tmp_path, capsys):
    save, marker = tmp_path / "ckpt", tmp_path / "pwned"
    assert pretrain([*FLAGS, "--save", str(save), "--train-iters", "1", "--eval-iters", "0"]) == 0
    model_file = save / "iter_0000001" / saving.model_file(0, 0)
    torch.save({"params": _Payload(str(marker))}, model_file)
    capsys.readouterr()
    assert pretrain([*FLAGS, "--load", str(save)]) == 1
    err = capsys.readouterr().err
    assert str(model_file) in err and "refused" in err
    assert not marker.exists()


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_the_run_resumes_exactly(tmp_path):
    long = ["--train-iters", "300", "--eval-iters", "0", "--exit-signal-handler"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_process(*long, "--save", str(straight), "--tensorboard-dir", str(tmp_path / "tb1"))
    proc = launch(*long, "--save", str(stopped), "--tensorboard-dir", str(tmp_path / "tb2"),
                  "--preemption-notice-seconds", "120")
    for line in proc.stdout:
        if "iteration        5/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "received signal SIGTERM" in out
    # The save on the notice reports its time against --preemption-notice-seconds.
    assert re.search(r"successfully saved checkpoint .*\(([\d.]+) s after the save was "
                     r"requested; within the 120 s preemption notice: \d+%\)", out), out[-2000:]
    iteration = find_checkpoint_to_load(stopped)[0]
    assert 5 <= iteration < 300
    run_process(*long, "--save", str(stopped), "--load", str(stopped),
                "--tensorboard-dir", str(tmp_path / "tb3"))
    first, resumed = scalars(tmp_path / "tb1"), scalars(tmp_path / "tb3")
    for tag in first:
        assert resumed[tag] == {k: v for k, v in first[tag].items() if k > iteration}, tag
    assert_identical(checkpoint_tensors(straight), checkpoint_tensors(stopped))


def test_planned_save_is_the_files_written_and_warns_past_the_notice(tmp_path, capsys):
    """The planner's bytes of a rank's save against the tensors of the files it wrote, and
    its warning at start when the save outlasts the notice."""
    save = tmp_path / "ckpt"
    flags = [*FLAGS, "--save", str(save), "--train-iters", "1", "--eval-iters", "0"]
    assert pretrain([*flags, "--preemption-notice-seconds", "1e-9"]) == 0
    out = capsys.readouterr().out
    config = validate_args(parse_args(flags))
    seconds, planned = planned_save_seconds(config, MEASURED_WRITE_GBPS)
    assert seconds == planned / (MEASURED_WRITE_GBPS * 1e9)
    assert f"WARNING: the planned save takes {seconds:.3g} s, longer than the 1e-09 s" in out
    assert "LONGER THAN the 1e-09 s preemption notice" in out
    assert planned == tensor_bytes(saved_files(save / "iter_0000001"))
    capsys.readouterr()
    assert pretrain([*flags, "--preemption-notice-seconds", "60", "--load", str(save),
                     "--train-iters", "2"]) == 0
    assert "WARNING: the planned save" not in capsys.readouterr().out
    assert pretrain([*FLAGS, "--preemption-notice-seconds", "30"]) == 2
    assert "--preemption-notice-seconds=30.0 needs --save" in capsys.readouterr().err


def test_exit_duration_saves_and_exits_zero(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--save", str(save), "--exit-duration-in-mins", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "exit duration of 1e-06 minutes reached" in out
    assert find_checkpoint_to_load(save)[0] == 1


def test_finetune_loads_the_model_only_and_needs_a_checkpoint(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--finetune", "--load", str(save)]) == 1
    assert f"--finetune: no checkpoint in --load {save}" in capsys.readouterr().err
    assert pretrain([*FLAGS, "--save", str(save), "--train-iters", "2", "--eval-iters", "0"]) == 0
    capsys.readouterr()
    assert pretrain([*FLAGS, "--load", str(save), "--finetune", "--train-iters", "2",
                     "--eval-iters", "0"]) == 0
    out = capsys.readouterr().out
    # Iteration 0, a fresh schedule (logged after step 1 of 2 of the linear decay:
    # 3e-3 x (1 - 1/2)), the checkpoint's weights.
    assert "resuming from" in out and "iteration        1/       2" in out
    assert "learning rate: 1.500000E-03" in out


def test_a_flipped_bit_in_a_checkpoint_file_is_refused_naming_it(tmp_path, capsys):
    """torch.load checks no CRC (nor does a memory-mapped load read one): without the
    check, the flipped weight or moment was loaded and training went on from it."""
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--save", str(save), "--train-iters", "1", "--eval-iters", "0"]) == 0
    for name in (saving.model_file(0, 0), saving.optim_file(0, 0, 0)):
        path = save / "iter_0000001" / name
        whole = path.read_bytes()
        flip_a_bit_of_the_largest_record(path)
        capsys.readouterr()
        assert pretrain([*FLAGS, "--load", str(save), "--eval-iters", "0"]) == 1
        err = capsys.readouterr().err
        assert str(path) in err and "CRC" in err, err
        path.write_bytes(whole)


def test_a_changed_value_in_checkpoint_metadata_is_refused_naming_it(tmp_path, capsys):
    """A digit changed in metadata.json still parses: the consumed samples (where the data
    resumes) would have been taken as written."""
    save = tmp_path / "ckpt"
    assert pretrain([*FLAGS, "--save", str(save), "--train-iters", "2", "--eval-iters", "0"]) == 0
    path = save / "iter_0000002" / "metadata.json"
    text = path.read_text()
    assert '"consumed_train_samples": 8' in text
    path.write_text(text.replace('"consumed_train_samples": 8', '"consumed_train_samples": 9'))
    capsys.readouterr()
    assert pretrain([*FLAGS, "--load", str(save), "--eval-iters", "0"]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "checksum" in err, err


def test_a_lost_tracker_resumes_from_the_only_checkpoint_and_names_itself(tmp_path, capsys):
    """The first save stopped between publishing iter_0000002 and writing the tracker (or
    the tracker lost): its one checkpoint is what there is to resume from. With two, the
    user chooses; a tracker naming no checkpoint is named in the error."""
    save = tmp_path / "ckpt"
    flags = [*FLAGS, "--save", str(save), "--eval-iters", "0"]
    assert pretrain([*flags, "--train-iters", "2"]) == 0
    tracker = save / TRACKER_FILENAME
    tracker.unlink()
    capsys.readouterr()
    assert pretrain([*flags, "--load", str(save), "--train-iters", "3"]) == 0
    assert "at iteration 2" in capsys.readouterr().out
    tracker.unlink()
    assert pretrain([*flags, "--load", str(save)]) == 1
    assert f"checkpoint tracker {tracker} is missing" in capsys.readouterr().err
    tracker.write_text("7")
    assert pretrain([*flags, "--load", str(save)]) == 1
    assert f"checkpoint tracker {tracker} names iteration 7" in capsys.readouterr().err
