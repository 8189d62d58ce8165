"""A watchdog that ends a rank whose training stopped progressing, so the restart policy
(torchrun --max-restarts, a requeue) can run.

A rank hung or stopped (SIGSTOP, a wedged driver) holds the others in their next
collective. NCCL's watchdog aborts them after --distributed-timeout-minutes; gloo's timeout
should raise, but a wait on a gloo collective whose peer stopped at the wrong moment can
block forever (torch 2.13: the reduce-scatter of the gradients, the all-gather of the
parameters, even a synchronous all-reduce; found by tools/chaos.py). So the monitor notes
progress at each step's start and end and at each evaluation iteration, and a thread ends
the process when none came for twice the collective timeout: a collective that works has
given up by then. It watches the training loop only (armed by the first step): loading and
building come before. A checkpoint's file writes and the wait for --async-save's writer
are `suspended`: their length grows with the model and the file system, not with a peer,
and a slow disk must never cost the checkpoint; the save's collectives stay watched.
"""

import contextlib
import os
import sys
import threading
import time


def _end_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)  # the hung collective holds the main thread: no unwinding


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, on_stall=_end_process):
        self.limit_s, self.rank, self.on_stall = 2.0 * timeout_s, rank, on_stall
        self.last: float | None = None
        self._suspended = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megalite-watchdog",
                                        daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Training progressed (a step starts or ends, an evaluation iteration ends)."""
        self.last = time.monotonic()

    @contextlib.contextmanager
    def suspended(self):
        """Not watched inside: local I/O (a checkpoint's writes) that may take long."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1
            if self.last is not None:
                self.beat()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.limit_s / 10)):
            last = self.last
            stalled = 0.0 if last is None or self._suspended else time.monotonic() - last
            if stalled > self.limit_s:
                self.on_stall(f"error (rank {self.rank}): no training progress for "
                              f"{self.limit_s:g} s (twice --distributed-timeout-minutes): a "
                              f"collective waits for a rank that hung or is gone; ending this "
                              f"process so the job restarts")
                return
