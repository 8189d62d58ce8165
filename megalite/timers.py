"""Megatron's phase timers (megatron/core/timers.py): named, levelled, summed over a log
interval, reduced over ranks when printed.

`--timing-log-level` picks the phases: 0 none (the log line's iteration time only; no
timer, no synchronisation runs), 1 the phases a step runs about once (gradient reduction,
optimizer, ...), 2 also those it runs per micro-batch (forward and backward compute,
pipeline send/recv). On an accelerator a timer records a timing event on the device's
stream when it starts and stops, so it measures the work and not its launch without
stalling the host (Megatron synchronises the device instead); the pairs are read when the
times are asked for, between steps. On a CPU, which runs work as it is issued, the host
clock stands in for the events, through the same lines.

Each phase is also a `torch.profiler.record_function` range while a profile is being
recorded (profiling.py), whatever the level, so a trace shows megalite's own phases.
"""

import contextlib
import time

import torch

# name -> (level, enclosing phase). Phases without an enclosing one do not overlap, so
# their sum is at most the iteration time; a child's time is part of its parent's.
PHASES = {
    "batch-generator": (1, None),
    "loss-all-reduce": (1, None),
    "forward-backward": (1, None),
    "forward-compute": (2, "forward-backward"),
    "backward-compute": (2, "forward-backward"),
    "weight-grad-compute": (2, "forward-backward"),  # --pipeline-schedule zb-h1's W passes
    "pipeline-send-recv": (2, "forward-backward"),
    "pipeline-send-wait": (2, "forward-backward"),
    "all-grads-sync": (1, None),
    "layernorm-grads-all-reduce": (1, "all-grads-sync"),
    "embedding-grads-all-reduce": (1, "all-grads-sync"),
    "grads-compress": (1, "all-grads-sync"),  # PowerSGD's matmuls and orthogonalisation
    "optimizer": (1, None),
    "optimizer-unscale-and-check-inf": (1, "optimizer"),
    "optimizer-clip-main-grad": (1, "optimizer"),
    "grad-norm-all-reduce": (1, "optimizer-clip-main-grad"),
    "optimizer-inner-step": (1, "optimizer"),
    "optimizer-copy-main-to-model-params": (1, "optimizer"),
    # Inside the optimizer; under --overlap-param-gather inside the next forward-compute.
    "params-all-gather": (1, "optimizer-copy-main-to-model-params"),
}
# The phases that are communication (or waiting for a peer) rather than computation.
COMMUNICATION = ("loss-all-reduce", "pipeline-send-recv", "pipeline-send-wait",
                 "all-grads-sync", "grad-norm-all-reduce", "params-all-gather")
# A rank's own work in a step: what --log-straggler compares across ranks.
COMPUTE = ("batch-generator", "forward-compute", "backward-compute", "weight-grad-compute",
           "optimizer-inner-step")


def synchronize(device: torch.device | None):
    """Wait for the device's queued work (kernels run asynchronously); nothing on a CPU."""
    if device is not None and device.type != "cpu":
        torch.accelerator.synchronize(device)


class HostEvent:
    """torch.Event's timing interface on the host clock, for a CPU: its work runs as it is
    issued, so the time the host records is the work's."""

    def record(self):
        self.seconds = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.seconds - self.seconds) * 1e3


def timing_event(device: torch.device | None):
    """A recorded point in `device`'s stream whose time can be read later."""
    if device is None or device.type == "cpu":
        event = HostEvent()
    else:  # gpu_check: train_350m
        event = torch.Event(device=device, enable_timing=True)
    event.record()
    return event


class Timer:
    """Seconds spent in one phase: an event at each start and stop, read (and the host
    made to wait for the last of them) only by `read`, between steps."""

    def __init__(self, device: torch.device | None):
        self.device, self.elapsed_s, self._started = device, 0.0, None
        self._pending: list[tuple] = []  # (start, stop) events not yet read

    def start(self):
        self._started = timing_event(self.device)

    def stop(self):
        self._pending.append((self._started, timing_event(self.device)))
        self._started = None
        while self._pending and self._pending[0][1].query():  # the pairs already done
            self._add(*self._pending.pop(0))

    def _add(self, start, stop):
        self.elapsed_s += start.elapsed_time(stop) / 1e3

    def read(self) -> float:
        """Every interval so far, waiting for the device to reach the last stop."""
        for start, stop in self._pending:
            stop.synchronize()
            self._add(start, stop)
        self._pending.clear()
        return self.elapsed_s


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _phase(timer: Timer | None, name: str | None):
    """One use of a phase: its timer (if timed) inside its profiler range (if profiling)."""
    with _NOTHING if name is None else torch.profiler.record_function(name):
        if timer is not None:
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.stop()


class Timers:
    """`with timers("optimizer"): ...` times a phase if its level is on (or `extra` names
    it) and marks it for the profiler while `profiling` is set; otherwise it is a shared
    no-op context."""

    def __init__(self, level: int = 0, device: torch.device | None = None,
                 extra: tuple[str, ...] = ()):
        self.timers = {name: Timer(device) for name, (lvl, _) in PHASES.items()
                       if lvl <= level or name in extra}
        self.profiling = False

    def __call__(self, name: str):
        timer = self.timers.get(name)
        if timer is None and not self.profiling:
            return _NOTHING
        return _phase(timer, name if self.profiling else None)

    def elapsed(self, reset: bool = True) -> dict[str, float]:
        """Seconds in each timed phase since the last reset."""
        out = {name: t.read() for name, t in self.timers.items()}
        if reset:
            for t in self.timers.values():
                t.elapsed_s = 0.0
        return out


NO_TIMERS = Timers(0)
"""Times nothing and never profiles: the default of the classes that take timers."""


def timers_report(names: list[str], per_rank_ms: torch.Tensor, option: str) -> list[str]:
    """Megatron's timer lines from `per_rank_ms` [ranks, names] (ms per iteration; 0 where
    a rank never ran the phase): max, (min, max) or every rank's time."""
    used = [i for i in range(len(names)) if (per_rank_ms[:, i] > 0).any()]
    if option == "all":
        lines = ["times across ranks (ms):"]
        for i in used:
            lines.append(f"  {names[i]}:")
            lines += [f"     rank {r:2d}: {t:.2f}"
                      for r, t in enumerate(per_rank_ms[:, i].tolist())]
        return lines
    lines = ["max time across ranks (ms):" if option == "max"
             else "(min, max) time across ranks (ms):"]
    for i in used:
        ran = per_rank_ms[:, i][per_rank_ms[:, i] > 0]
        label = (names[i] + " ").ljust(48, ".")
        lines.append(f"    {label}: {ran.max().item():.2f}" if option == "max" else
                     f"    {label}: ({ran.min().item():.2f}, {ran.max().item():.2f})")
    return lines
