"""The training loop's saves, synchronous or --async-save's, and their two log lines.

Megatron-LM once printed "saved checkpoint" with the time of a save that was only requested
(Megatron-LM #1763); here the two moments have lines and times of their own:
  requested: how long training was blocked (the whole save when synchronous, the snapshot
             when asynchronous, and the wait for the previous save's writes if they are
             still running);
  finished:  "successfully saved checkpoint at iteration N", printed once the tracker
             names it, with the seconds from the request (and their share of
             --preemption-notice-seconds).
The loop calls `save` at a save iteration (else `save_non_persistent`, which saves at
--non-persistent-save-interval), `poll` every iteration (every rank: it may run the
collective that publishes a finished asynchronous save) and `wait` before it returns.
"""

import time
from contextlib import nullcontext
from typing import Callable

import torch.distributed as dist

from megalite.checkpointing.async_save import AsyncCheckpointer
from megalite.checkpointing.local import drop_stale, save_local
from megalite.checkpointing.saving import save_checkpoint
from megalite.checkpointing.state import CheckpointState
from megalite.parallel_state import print_rank_0


class CheckpointSaver:
    """Saves `ckpt` (training.run_training's) to --save."""

    def __init__(self, ckpt: CheckpointState, device, writing: Callable = nullcontext):
        """`writing()`: the context of the file writes and of waits for them (the
        monitor's watchdog suspended, monitoring/watchdog.py)."""
        self.ckpt, self.flags, self.writing = ckpt, ckpt.config.checkpoint, writing
        self.directory = self.flags.save
        self.writer = (AsyncCheckpointer(device, dist.group.WORLD, writing)
                       if self.flags.async_save else None)

    def save(self, iteration: int) -> None:
        if self.writer is None:
            start = time.perf_counter()
            save_checkpoint(self.directory, iteration, self.ckpt, self.writing)
            self._finished(iteration, time.perf_counter() - start)
            return
        pending, start = self.writer.pending, time.perf_counter()
        self._report(self.writer.finalize(blocking=True))  # a save still pending: its line
        waited = time.perf_counter() - start  # saves closer than their writes stall too
        stall = waited + self.writer.save(self.directory, iteration, self.ckpt)
        wait = ("" if pending is None else f", {waited * 1e3:.1f} ms of it waiting for the "
                f"save of iteration {pending.iteration} to be written")
        print_rank_0(f"  save of checkpoint at iteration {iteration:7d} requested: training "
                      f"blocked {stall * 1e3:.1f} ms{wait} (snapshot queued; copied to host memory "
                      f"before the next optimizer step); writing in the background "
                      f"(--async-save)")

    def save_non_persistent(self, iteration: int) -> None:
        """Every rank, at an iteration without a persistent save: a node-local save if
        --non-persistent-save-interval says so (synchronous: a local disk is fast)."""
        interval, local = (self.flags.non_persistent_save_interval,
                           self.flags.non_persistent_local_ckpt_dir)
        if not interval or iteration % interval:
            return
        start = time.perf_counter()
        save_local(local, iteration, self.ckpt, self.writing)
        dist.barrier()  # for the time and the log: every rank's file is written
        seconds = time.perf_counter() - start
        print_rank_0(f"  saved non-persistent checkpoint at iteration {iteration:7d} to "
                      f"{local} ({seconds:.2f} s{self._against_notice(seconds)})")

    def poll(self) -> None:
        """Every rank, every iteration: publish the pending save if every rank wrote it."""
        if self.writer is not None and self.writer.pending is not None:
            self._report(self.writer.finalize(blocking=False))

    def wait(self) -> None:
        """Every rank, before exiting: the pending save written and published."""
        if self.writer is not None:
            self._report(self.writer.finalize(blocking=True))

    def _report(self, published) -> None:
        if published is None:
            return
        print_rank_0(f"  optimizer steps waited {self.writer.waited_s * 1e3:.1f} ms for the "
                      f"snapshot's copies to host memory")
        self.writer.waited_s = 0.0
        self._finished(*published)

    def _finished(self, iteration: int, seconds: float) -> None:
        local = self.flags.non_persistent_local_ckpt_dir
        if local is not None:
            drop_stale(local, iteration)
        print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to "
                      f"{self.directory} ({seconds:.2f} s after the save was requested"
                      f"{self._against_notice(seconds)})")

    def _against_notice(self, seconds: float) -> str:
        """The save's time against --preemption-notice-seconds: a save on the notice that
        outlasts it is cut off when the node goes."""
        notice = self.flags.preemption_notice_seconds
        if notice is None:
            return ""
        verdict = "within" if seconds <= notice else "LONGER THAN"
        return f"; {verdict} the {notice:g} s preemption notice: {100 * seconds / notice:.0f}%"
