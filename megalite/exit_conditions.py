"""Stopping early without losing work: on a signal (--exit-signal-handler) or after a
wall-clock budget (--exit-duration-in-mins), every rank stops at the same iteration
boundary so the checkpoint written there is whole.

A signal reaches one rank (Slurm's --signal, a preemption notice, torchrun forwarding
SIGTERM) or several at slightly different times; the handler only records it, and once
per iteration a MAX all-reduce over all ranks turns "any rank got it" into a decision
every rank takes at the same iteration.
"""

import signal
import time

import torch
import torch.distributed as dist

from megalite.config import CheckpointConfig

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitConditions:
    def __init__(self, config: CheckpointConfig, device: torch.device):
        self.config, self.device = config, device
        self.start = time.monotonic()
        self.received: int | None = None
        self.signalled = False
        """Every rank: a signal (on any rank) stopped the run."""
        if config.exit_signal_handler:
            for signum in SIGNALS:
                signal.signal(signum, self._record)

    def _record(self, signum, _frame):
        self.received = signum

    def check(self) -> str | None:
        """Every rank, every iteration: why all ranks stop now, or None."""
        limit = self.config.exit_duration_in_mins
        if not self.config.exit_signal_handler and limit is None:
            return None
        minutes = (time.monotonic() - self.start) / 60.0
        flags = torch.tensor([self.received or 0, limit is not None and minutes > limit],
                             dtype=torch.float32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            self.signalled = True
            return f"received signal {signal.Signals(int(flags[0])).name}"
        if flags[1] > 0:
            return f"exit duration of {limit} minutes reached"
        return None
