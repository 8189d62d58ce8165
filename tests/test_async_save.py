"""--async-save in one process (docs/design.md §16): the files are byte for byte those of a
synchronous save of the same state (with the optimizer state on the host too), a run
resumed from them ends bit-exactly where the uninterrupted run does, the "requested" and
"finished" log lines come apart, and a process killed at any point of an asynchronous write
leaves the previous checkpoint tracked and loadable; the memory planner counts the host
buffers the snapshot holds, and a rank copies to host memory only what it writes."""

import contextlib
import io
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.checkpointing.async_save import TEST_HOOK, HostBuffers, _Pending
from megalite.arguments import parse_args
from megalite.checkpointing.saving import model_file, rank_files
from megalite.checkpointing.state import CheckpointState
from megalite.checkpointing.storage import find_checkpoint_to_load
from megalite.memory_estimate import estimate_memory
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import FORKSERVER_PRELOAD
from megalite.training import build_model, build_optimizer, pretrain
from megalite.validation import validate_args

from tests.helpers import (assert_identical, assert_same_files, checkpoint_tensors, flags_with,
                           hold_first_snapshot, saved_files, tensor_bytes)

FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
                   "--save-interval", "2", vocab_size=61, make_vocab_size_divisible_by=None,
                   hidden_size=32, seq_length=16, micro_batch_size=2, global_batch_size=4,
                   train_iters=6, lr="3e-3")
# Where the writer can die (async_save.TEST_HOOK): nothing written, some files, all files.
KILL_POINTS = ("before_write", "after_first_file", "before_publish")


def run(*flags) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pretrain([*FLAGS, *flags]) == 0
    return out.getvalue()


def test_async_save_writes_a_sync_saves_bytes_and_resumes_bit_exactly(tmp_path, monkeypatch):
    """6 steps saving synchronously every 2, against --async-save for 4 steps (exit),
    then a new run resumed from its checkpoint for 2 more: iter 2, 4 and 6 identical files.
    The first snapshot's copies are held back until the next optimizer step is about to
    run: its files are right only if that step waits for them (the pre-step hook)."""
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    run("--save", str(sync))
    hold_first_snapshot(monkeypatch)
    write = _Pending.write

    def slow_write(self, *args):  # iteration 2's write outlasts steps 3 and 4: the save
        write(self, *args)  # at 4 publishes it, and must still print its line
        if self.iteration == 2:
            time.sleep(1.0)
    monkeypatch.setattr(_Pending, "write", slow_write)
    first = run("--save", str(asyn), "--async-save", "--exit-interval", "4")
    second = run("--save", str(asyn), "--load", str(asyn), "--async-save")
    assert "resuming from" in second and "at iteration 4" in second
    for iteration in (2, 4, 6):
        name = f"iter_{iteration:07d}"
        assert_same_files(sync / name, asyn / name)
    # The request is logged when the step resumes, the finish only once published.
    requested = first.index("save of checkpoint at iteration       2 requested")
    finished = first.index("successfully saved checkpoint at iteration       2")
    assert requested < finished
    assert "training blocked" in first[requested:finished]
    # The save at 4 waited for iteration 2's slow write: its stall says so and includes it.
    stall = re.search(r"iteration +4 requested: training blocked ([\d.]+) ms, ([\d.]+) ms of "
                      r"it waiting for the save of iteration 2 to be written", first)
    assert stall and float(stall[1]) >= float(stall[2]) > 0, first
    assert "successfully saved checkpoint at iteration       4" in first
    assert planned_host_buffers("--save", str(asyn), "--async-save") == \
        tensor_bytes(saved_files(asyn / "iter_0000002"))


def planned_host_buffers(*flags) -> int:
    config = validate_args(parse_args([*FLAGS, *flags]), 1)
    (rank,) = estimate_memory(config, "cpu")
    return rank.async_save_host


def test_async_save_of_offloaded_optimizer_state_writes_a_sync_saves_bytes(tmp_path):
    """--optimizer-cpu-offload keeps the fp32 main copy and the moments on the host and
    the parameters on the device: the snapshot copies both through the same lines (issue
    #39: on CUDA a side-stream call made only for device tensors crashed the first save)."""
    offload = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--train-iters", "2"]
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    run(*offload, "--save", str(sync))
    run(*offload, "--save", str(asyn), "--async-save")
    assert_same_files(sync / "iter_0000002", asyn / "iter_0000002")


def test_a_rank_copies_to_host_only_what_it_writes(tmp_path):
    """Under FSDP2 every DP rank takes part in gathering each parameter, but only DP rank 0
    writes the model file: a rank's host buffers hold exactly the tensors of the files it
    writes (issue #39: every DP rank kept a host copy of the whole TP shard). DP rank 1 is
    played by this one process with its DP coordinate changed: at one rank the gathers are
    the identity, and which files a rank writes follows from its coordinates."""
    config = validate_args(parse_args([*FLAGS, "--use-torch-fsdp2", "--save", str(tmp_path)]))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = ParallelState(RankGrid(1), 0)
        model = build_model(config, state, torch.device("cpu"), None)
        optimizer, _ = build_optimizer(model, config, state)
        for dp_rank in (0, 1):
            state.dp_rank = dp_rank
            buffers = HostBuffers(torch.device("cpu"))
            buffers.start()
            files = rank_files(CheckpointState(model, optimizer, None, state, config),
                               buffers.copy)
            assert (model_file(0, 0) in files) == (dp_rank == 0)
            assert buffers.nbytes == tensor_bytes(files) > 0, dp_rank
    finally:
        dist.destroy_process_group()


def _pretrain(flags: list[str], kill: str | None):
    """A child's run: one thread (as a rank of spawn.run_distributed), quiet."""
    if kill:
        os.environ[TEST_HOOK] = f"{kill}:4"
    torch.set_num_threads(1)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        sys.exit(pretrain([*FLAGS, *flags]))


def launch(*flags, kill: str | None = None):
    """pretrain in a child forked from spawn.py's forkserver, which has imported megalite
    (`kill`: async_save.TEST_HOOK's point at the save of iteration 4)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    proc = ctx.Process(target=_pretrain, args=(list(flags), kill))
    proc.start()
    return proc


def finish(proc) -> int:
    proc.join(timeout=300)
    return proc.exitcode


@pytest.mark.slow
def test_a_process_killed_during_an_async_write_leaves_the_previous_checkpoint(tmp_path):
    """Killed (SIGKILL) while the save of iteration 4 is being written, at each point:
    the tracker still names iteration 2, whose files are those of a synchronous save;
    a run resumed from it ends where the uninterrupted run ends."""
    # Child processes all: one thread each (more threads round otherwise).
    procs = {point: launch("--async-save", "--save", str(tmp_path / point), kill=point)
             for point in KILL_POINTS}
    sync = tmp_path / "sync"
    assert finish(launch("--save", str(sync))) == 0
    for point, proc in procs.items():
        assert finish(proc) == -9, point
        save = tmp_path / point
        assert find_checkpoint_to_load(save) == (2, save / "iter_0000002"), point
        assert not (save / "iter_0000004").exists(), point
        assert_same_files(sync / "iter_0000002", save / "iter_0000002")
    resumed = tmp_path / "after_first_file"
    assert finish(launch("--save", str(resumed), "--load", str(resumed), "--async-save")) == 0
    assert_identical(checkpoint_tensors(sync), checkpoint_tensors(resumed))
