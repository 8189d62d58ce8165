"""--async-save (docs/design.md §16): a save in three parts, of which training waits for one.

  1. snapshot (the stall): every rank builds the files a synchronous save writes
     (saving.rank_files), each tensor to be copied into a host buffer kept from the last
     save (HostBuffers). The writer thread makes the copies while the next step's forward
     and backward run (on an accelerator on a side stream into pinned memory), and the
     next optimizer step waits for them (a pre-step hook on AdamW): nothing a snapshot
     copies changes before AdamW's step (what does, rank_files copies on the device first);
  2. write: a background thread of this process torch.saves those files into the staging
     directory, each fsynced and renamed (storage.save_tensor_file): the same bytes;
  3. publish: `finalize`, which every rank calls at the same iterations (each iteration
     while a save is pending, before the next save, at exit): a MAX all-reduce of "still
     writing" and "failed" over all ranks; only when no rank is writing does rank 0 commit
     (metadata, rename, tracker). No rank decides alone that the save is done, so all
     agree on which save is published and when.
A second save while one is pending first waits for it (its writes, then its publish).
A crash before publish leaves the previous checkpoint tracked: the new one is a staging
directory that nothing loads.

A thread rather than a process: torch.save spends its time in the zip writer and the
file system, which release the GIL, and a thread shares the host buffers without pickling
or shared memory (docs/design.md, "Asynchronous and non-persistent checkpoints", has the
measurement).
"""

import os
import signal
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megalite.checkpointing import remote
from megalite.checkpointing.saving import (begin_save, checkpoint_metadata, publish,
                                           rank_files)
from megalite.checkpointing.state import CheckpointState
from megalite.checkpointing.storage import save_tensor_file
from megalite.errors import CheckpointError
from megalite.parallel_state import all_reduce_anywhere

TEST_HOOK = "MEGALITE_ASYNC_SAVE_TEST_KILL"
"""Test-only: "<point>:<iteration>" kills this process (SIGKILL) at `point` of the save of
`iteration`: before_write, after_first_file (in the writer), before_publish (rank 0, all
files written)."""


def _test_kill(point: str, iteration: int) -> None:
    if os.environ.get(TEST_HOOK) == f"{point}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


class HostBuffers:
    """Host tensors reused from save to save: the i-th copy of a save lands in the i-th
    buffer (a save copies the same tensors in the same order), reallocated only when its
    shape or dtype changes. `copy` only queues; `fill`, in the writer thread, makes the
    copies while the next step's forward and backward run, and the next optimizer step
    waits for them (AsyncCheckpointer._before_step).

    The same lines on every device, through its torch module (torch.cuda, torch.cpu): on
    an accelerator the copies run on a side stream, after the work that made the values,
    into pinned memory, so they overlap the step; torch.cpu's streams and events are
    no-ops, and a CPU's copies are plain copies in the writer thread. Values on the host
    (the optimizer state under --optimizer-cpu-offload) take the same lines."""

    def __init__(self, device: torch.device):
        self.device, self.streams = device, torch.get_device_module(device.type)
        accelerator = torch.accelerator.current_accelerator()
        # Pinned where the device has it: a copy from the device that does not block.
        self.pin = accelerator is not None and accelerator.type == device.type
        self.stream = self.streams.Stream()
        self.buffers, self.queued, self.ready = [], [], None

    def start(self) -> None:
        self.queued = []

    def copy(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or tensor.dtype
        i = len(self.queued)  # this save's i-th copy
        buffer = self.buffers[i] if i < len(self.buffers) else None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != dtype:
            buffer = torch.empty(tensor.shape, dtype=dtype, pin_memory=self.pin)
            self.buffers[i:i + 1] = [buffer]  # replaced, or appended when i is new
        self.queued.append((buffer, tensor.detach()))
        return buffer

    def values_made(self) -> None:
        """Training thread, after the last `copy`: the point of its stream after which
        every queued value is made (the copies start there)."""
        self.ready = self.streams.Event()
        self.ready.record(self.streams.current_stream(self.device))

    def fill(self) -> None:
        """Writer thread: the queued copies, returning once they are in host memory. The
        queue holds each value (a gathered one too) until then: no stream can reuse its
        memory while it is being copied."""
        done = self.streams.Event()
        with self.streams.stream(self.stream):
            self.ready.wait(self.stream)
            for buffer, tensor in self.queued:
                buffer.copy_(tensor, non_blocking=True)  # gpu_check: save_paths
            done.record(self.stream)
        done.synchronize()
        self.queued = []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class _Pending:
    """One save between its snapshot and its publish."""

    def __init__(self, save: str, iteration: int, metadata: dict | None, config,
                 requested: float):
        self.save, self.iteration, self.metadata, self.config = save, iteration, metadata, config
        self.requested, self.error, self.thread = requested, None, None
        self.uploads = None  # in a bucket: this rank's objects' records (remote.upload)
        self.copied = threading.Event()  # the host buffers hold the snapshot

    def write(self, files: dict[str, dict], staging: Path, buffers: HostBuffers) -> None:
        try:
            try:
                buffers.fill()
            finally:
                self.copied.set()  # never leave the optimizer step waiting
            _test_kill("before_write", self.iteration)
            for i, (name, obj) in enumerate(files.items()):
                save_tensor_file(obj, staging / name)
                if i == 0:
                    _test_kill("after_first_file", self.iteration)
            if remote.is_remote(self.save):
                self.uploads = remote.upload(self.save, self.iteration, staging, list(files))
        except Exception as error:  # reported by every rank at the next finalize
            self.error = error


class AsyncCheckpointer:
    """Owns the save in flight. `group`: the ranks that save together (all of them)."""

    def __init__(self, device: torch.device, group=None, writing: Callable = nullcontext):
        """`writing()`: the context of a wait for this rank's writer (the watchdog
        suspended: a slow disk is not a hung peer)."""
        self.group, self.buffers, self.writing = group, HostBuffers(device), writing
        self.pending: _Pending | None = None
        self.waited_s = 0.0
        """Seconds optimizer steps waited for a snapshot's copies (part of the stall)."""
        self._hooked = set()

    def _before_step(self, *_) -> None:
        """Before AdamW changes anything a snapshot copies: its copies must be done."""
        pending = self.pending
        if pending is not None and not pending.copied.is_set():
            start = time.perf_counter()
            pending.copied.wait()
            self.waited_s += time.perf_counter() - start

    def save(self, save: str, iteration: int, ckpt: CheckpointState) -> float:
        """Every rank at the same iteration: waits for a pending save, snapshots, starts
        the writer. Returns the seconds training was blocked (the stall)."""
        self.finalize(blocking=True)
        requested = time.perf_counter()
        staging = begin_save(save, iteration, ckpt.config)
        self.buffers.start()
        files = rank_files(ckpt, self.buffers.copy)
        metadata = checkpoint_metadata(ckpt) if dist.get_rank() == 0 else None
        adam = ckpt.optimizer.adam
        if id(adam) not in self._hooked:  # AdamW updates params, main and moments
            adam.register_step_pre_hook(self._before_step)
            self._hooked.add(id(adam))
        self.buffers.values_made()
        pending = _Pending(save, iteration, metadata, ckpt.config, requested)
        pending.thread = threading.Thread(target=pending.write,
                                          args=(files, staging, self.buffers),
                                          name=f"async-save-{iteration}", daemon=True)
        pending.thread.start()
        self.pending = pending
        return time.perf_counter() - requested

    def finalize(self, blocking: bool) -> tuple[int, float] | None:
        """Every rank at the same iteration. Publishes the pending save if every rank has
        written its files (`blocking`: after waiting for this rank's writer). Returns the
        published iteration and the seconds since its save was requested, or None."""
        pending = self.pending
        if pending is None:
            return None
        if blocking:
            with self.writing():
                pending.thread.join()
        flags = torch.tensor([pending.thread.is_alive(), pending.error is not None],
                             dtype=torch.float32)
        all_reduce_anywhere(flags, self.group, op=dist.ReduceOp.MAX)
        writing, failed = flags.tolist()
        if writing:
            return None
        self.pending = None
        if failed:
            here = f": {pending.error!r}" if pending.error is not None else " (on another rank)"
            raise CheckpointError(f"asynchronous save of iteration {pending.iteration} to "
                                  f"{pending.save} failed{here}; the previous checkpoint "
                                  f"stays the tracked one")
        uploads = (remote.gather_uploads(pending.uploads, None, self.group)
                   if remote.is_remote(pending.save) else None)
        if dist.get_rank(self.group) == 0:
            _test_kill("before_publish", pending.iteration)
            publish(pending.save, pending.iteration, pending.metadata, pending.config, uploads)
        dist.barrier(group=self.group)
        return pending.iteration, time.perf_counter() - pending.requested
