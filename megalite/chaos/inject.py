"""The in-rank half of a fault campaign: `python -m megalite.chaos.inject FLAGS...` is
pretrain_gpt.py with a few megalite functions wrapped, so that the fault tools/chaos.py
armed fires on its rank at its phase and iteration; with $MEGALITE_CHAOS_DIR unset it is
pretrain_gpt.py. The wrappers live here, not in the library: training runs no test hook.

The campaign arms one fault at a time, as JSON in $MEGALITE_CHAOS_DIR/armed.json (re-read
when it changes): {"id", "where", "rank", "iteration", "occurrence", "pick"}. It fires at
the `occurrence`-th call of its point on `rank` from iteration `iteration` on, once ever:
fired_<id>.json (the time, the iteration) is written first, and the campaign reads the
fault's moment from it. Points (`where`):
  forward, backward, grad_reduce, optimizer   SIGKILL in that phase of a step
  save_sync, save_async, save_local           SIGKILL after this rank writes a file of a
                                              save (async: in the writer thread)
  publish, tracker                            SIGKILL on rank 0 before the commit, or after
                                              the rename but before the tracker's write
  load                                        SIGKILL when a checkpoint file is read
  nan                                         a NaN written into one local gradient before
                                              the data-parallel reduction
  disk_full                                   RLIMIT_FSIZE set to 0 at the iteration's
                                              start: every later file write of the rank
                                              fails with EFBIG (Python ignores SIGXFSZ)
"""

import functools
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch

from megalite.checkpointing import async_save, loading, local, saving, storage
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel
from megalite.monitoring.monitor import Monitor
from megalite.training import pretrain

DIR_ENV = "MEGALITE_CHAOS_DIR"
ARMED = "armed.json"


def fired_path(directory: Path, fault_id: int) -> Path:
    return Path(directory) / f"fired_{fault_id}.json"


class Injector:
    """This rank's view of the armed fault."""

    def __init__(self, directory: Path, rank: int):
        self.directory, self.rank = Path(directory), rank
        self.iteration, self.calls = 0, 0
        self.fault, self._stamp = None, None

    def _read(self) -> dict | None:
        path = self.directory / ARMED
        try:
            stamp = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if stamp != self._stamp:
            self._stamp, fault = stamp, json.loads(path.read_text())
            if self.fault is None or fault["id"] != self.fault["id"]:
                self.calls = 0
            self.fault = fault
        return self.fault

    def due(self, where: str) -> dict | None:
        """The armed fault if this call of `where` is the one it fires at (counted)."""
        fault = self._read()
        if (fault is None or fault["where"] != where or fault["rank"] != self.rank
                or self.iteration < fault["iteration"]
                or fired_path(self.directory, fault["id"]).exists()):
            return None
        self.calls += 1
        if self.calls < fault.get("occurrence", 1):
            return None
        record = {"time": time.time(), "iteration": self.iteration, "rank": self.rank,
                  "where": where}
        fired_path(self.directory, fault["id"]).write_text(json.dumps(record))
        print(f"megalite-chaos: fault {fault['id']} ({where}) fires on rank {self.rank} at "
              f"iteration {self.iteration}", file=sys.stderr, flush=True)
        return fault

    def kill_if_due(self, where: str) -> None:
        if self.due(where) is not None:
            os.kill(os.getpid(), signal.SIGKILL)


def _wrap(owner, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return result
    setattr(owner, name, wrapper)


def install(injector: Injector) -> None:
    """Wrap the points of the module docstring."""
    def kill(where):
        return lambda *_, **__: injector.kill_if_due(where)

    def step_starts(_monitor, done):
        injector.iteration = done + 1
        if injector.due("disk_full") is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def before_reduction(buffer):
        fault = injector.due("nan")
        if fault is not None:
            params = [p for bucket in buffer.buckets for p in bucket.params]
            grad = params[int(fault["pick"] * len(params))].main_grad.view(-1)
            grad[int(fault["pick"] * 7919) % grad.numel()] = float("nan")

    def before_tracker(path, *_):
        if Path(path).name == storage.TRACKER_FILENAME:
            injector.kill_if_due("tracker")

    _wrap(Monitor, "before_step", before=step_starts)
    _wrap(GPTModel, "forward", before=kill("forward"))
    _wrap(torch.autograd, "backward", before=kill("backward"))
    _wrap(GradBuffer, "_launch", before=kill("grad_reduce"))
    _wrap(GradBuffer, "finish", before=before_reduction)
    _wrap(torch.optim.AdamW, "step", before=kill("optimizer"))
    _wrap(saving, "save_tensor_file", after=kill("save_sync"))
    _wrap(async_save, "save_tensor_file", after=kill("save_async"))
    _wrap(local, "save_tensor_file", after=kill("save_local"))
    _wrap(saving, "commit", before=kill("publish"))
    _wrap(storage, "_atomic_write", before=before_tracker)
    _wrap(loading, "load_tensor_file", before=kill("load"))
    _wrap(local, "load_tensor_file", before=kill("load"))


def main(argv=None) -> int:
    directory = os.environ.get(DIR_ENV)
    if directory:
        install(Injector(Path(directory), int(os.environ.get("RANK", "0"))))
    return pretrain(argv)


if __name__ == "__main__":
    sys.exit(main())
