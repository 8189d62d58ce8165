"""One run of a campaign: its job started under its policy (job.py), its faults armed one
after another as its log says where training is, files damaged between restarts and fixed
as docs/troubleshooting.md says when the job stops naming the damage, requeued until it
ends; what each fault did (`Record`), for report.py.

A fault's moment is when it fired (inject.py's record, or when the campaign signalled or
damaged); its recovery time runs from there to the log line of the first iteration after
the next resume, and its lost steps are the iterations logged before it that the resume
repeats. The next fault is armed when one has recovered, `after` iterations past the
resume.
"""

import contextlib
import json
import os
import queue
import random
import re
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megalite.atomic_write import atomic_write
from megalite.chaos.faults import SIGNALS, Fault, RunPlan
from megalite.chaos.inject import ARMED, DIR_ENV, fired_path
from megalite.chaos.job import Job
from megalite.checkpointing.storage import TRACKER_FILENAME, read_metadata, tracked_checkpoint
from megalite.errors import CheckpointError
from megalite.training_log import parse_log_line

_ITER_DIR = re.compile(r"iter_\d{7,}")
_START = re.compile(r"resuming from \S+ at iteration (\d+)|no checkpoint in \S+: starting")
DATA_NAME = "chaos_text_document"


@dataclass
class Settings:
    train_iters: int = 30
    save_interval: int = 4
    local_interval: int = 2
    timeout_minutes: float = 0.25  # --distributed-timeout-minutes: how long a hang lasts
    run_deadline_s: float = 900.0


def job_flags(run_dir: Path, settings: Settings, async_save: bool, local: bool) -> list[str]:
    """The campaign's training job: 2 layers, DP 2 with ZeRO-1, dropout, gloo."""
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--data-path",
             str(run_dir / "data" / DATA_NAME), "--split", "99,1,0", "--data-cache-path",
             str(run_dir / "cache"), "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
             "--global-batch-size", "4", "--train-iters", str(settings.train_iters),
             "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0", "--num-workers",
             "0", "--distributed-backend", "gloo", "--use-distributed-optimizer",
             "--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--save-interval",
             str(settings.save_interval), "--exit-signal-handler",
             "--distributed-timeout-minutes", str(settings.timeout_minutes),
             "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt")]
    if async_save:
        flags.append("--async-save")
    if local:
        flags += ["--non-persistent-save-interval", str(settings.local_interval),
                  "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                  str(run_dir / "local")]
    return flags


@dataclass
class Record:
    """What one fault did."""
    id: int
    kind: str
    group: str
    policy: str
    run: int
    rank: int
    state: str = "waiting"  # armed, prelude (stopped for a load fault), fired, resumed,
    #                         recovered, skipped (the run ended first)
    target: int | None = None  # the iteration it is armed at
    fired_at: float | None = None
    hook_iteration: int | None = None
    durable: int | None = None  # the tracker's iteration when it fired
    hit: str | None = None  # the file damaged
    resumed: int | None = None
    recovered_at: float | None = None
    errors: list[str] = field(default_factory=list)
    fixed: str | None = None
    requeued: bool = False  # once, without a fix, for the restart to meet the damage
    iteration: int | None = None  # the last iteration logged before it fired
    outcome: str | None = None

    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.fired_at

    def lost_steps(self) -> int | None:
        if self.resumed is None or self.iteration is None:
            return None
        return max(0, self.iteration - self.resumed)

    def as_json(self) -> dict:
        return {**asdict(self), "recovery_s": self.recovery_s(), "lost_steps": self.lost_steps()}


class RunDriver:
    def __init__(self, plan: RunPlan, directory: Path, data: Path, settings: Settings, env):
        self.plan, self.dir, self.settings, self.env = plan, directory, settings, env
        self.faults = plan.faults
        self.records = [Record(f.id, f.kind.name, f.kind.group, plan.policy, plan.index,
                               f.rank) for f in plan.faults]
        self.i, self.iterations, self.starts, self.signal_at = 0, [], [], None
        self.save = directory / "ckpt"
        (directory / "data").mkdir(parents=True)
        self.data = data
        for suffix in (".bin", ".idx"):
            shutil.copy(data.with_suffix(suffix), directory / "data" / (DATA_NAME + suffix))

    def run(self) -> list[Record]:
        deadline = time.time() + self.settings.run_deadline_s
        flags = job_flags(self.dir, self.settings, self.plan.async_save, self.plan.local)
        env = {**self.env, DIR_ENV: str(self.dir)}
        for attempt in range(2 + 2 * len(self.faults)):
            job = Job(self.plan.policy, flags, env, self.dir / "job.log",
                      f"{self.dir.name}-{attempt}-{random.getrandbits(32):08x}")
            try:
                job.start()
                self._attempt(job, deadline)
            finally:
                job.kill_all()
            if self.finished() or time.time() > deadline or not self._between_attempts():
                break
        for record in self.records:
            if record.fired_at is not None:
                record.iteration = self._last_iteration_before(record.fired_at)
        return self.records

    def _last_iteration_before(self, moment: float) -> int:
        """The last iteration logged before `moment` since the (re)start it happened in
        (an earlier attempt's iterations were repeated or lost before it)."""
        since, start = max(((t, k) for t, k in self.starts if t <= moment), default=(0.0, 0))
        return max((k for t, k in self.iterations if since <= t <= moment), default=start)

    def finished(self) -> bool:
        return tracked_iteration(self.save) == self.settings.train_iters

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, job: Job, deadline: float) -> None:
        while time.time() < deadline:
            with contextlib.suppress(queue.Empty):
                self._on_line(*job.lines.get(timeout=0.05))
            self._tick(job)
            job.replace_lost_node()
            if not job.running_agents():
                job.kill_all()  # the job step is over: its orphans go with it
                while not job.lines.empty():
                    self._on_line(*job.lines.get())
                return

    def _on_line(self, stamp: float, line: str) -> None:
        fields = parse_log_line(line)
        record = self.current()
        if fields is not None:
            self.iterations.append((stamp, fields["iteration"]))
            if record is not None and record.state == "resumed" and \
                    fields["iteration"] > record.resumed:
                record.recovered_at, record.state = stamp, "recovered"
                self._advance(record.resumed)
            return
        start = _START.search(line)
        if start:
            resumed = int(start[1] or 0)
            self.starts.append((stamp, resumed))
            if record is not None and record.state in ("fired", "resumed"):
                record.resumed, record.state = resumed, "resumed"
            elif record is not None and record.state == "waiting":
                self._arm(record, resumed)
        elif record is not None and record.fired_at is not None and len(record.errors) < 40 \
                and (line.startswith(("error", " > rank")) or "Error" in line):
            record.errors.append(line.strip()[:2000])

    def current(self) -> Record | None:
        return self.records[self.i] if self.i < len(self.records) else None

    def _advance(self, resumed: int) -> None:
        self.i += 1
        if self.current() is not None:
            self._arm(self.current(), resumed)

    def _arm(self, record: Record, base: int) -> None:
        fault = self.faults[self.i]
        target = min(base + fault.after, self.settings.train_iters - 1)
        if target <= base:
            for rest in self.records[self.i:]:
                rest.state = "skipped"
            self.i = len(self.records)
            return
        record.target, record.state, self.signal_at = target, "armed", None
        if fault.kind.how == "hook" and fault.kind.where != "load":
            self._write_armed(fault, target)

    def _write_armed(self, fault: Fault, iteration: int) -> None:
        armed = {"id": fault.id, "where": fault.kind.where, "rank": fault.rank,
                 "iteration": iteration, "occurrence": fault.occurrence, "pick": fault.pick}
        atomic_write(self.dir / ARMED, lambda f: f.write(json.dumps(armed).encode()))

    # ------------------------------------------------------------------ firing

    def _tick(self, job: Job) -> None:
        record = self.current()
        if record is None or record.state not in ("armed", "prelude"):
            return
        fault = self.faults[self.i]
        fired = fired_path(self.dir, fault.id)
        if fired.exists():
            info = json.loads(fired.read_text())
            record.hook_iteration = info["iteration"]
            return self._fired(record, info["time"])
        if record.state == "prelude" or fault.kind.how == "hook" and fault.kind.where != "load":
            return
        last = self.iterations[-1][1] if self.iterations else 0
        needs_checkpoint = fault.kind.how == "between" or fault.kind.where == "load"
        if last < record.target or needs_checkpoint and not (self.save / TRACKER_FILENAME).exists():
            return
        if self.signal_at is None:
            self.signal_at = time.time() + fault.delay_s
        if time.time() < self.signal_at:
            return
        self._inject(job, fault, record)

    def _inject(self, job: Job, fault: Fault, record: Record) -> None:
        kind = fault.kind
        if kind.how == "signal":
            signum = getattr(signal, SIGNALS[kind.name])
            sent = (job.kill_agent(fault.rank) if kind.where == "agent" else
                    job.signal_job(signum) if kind.where == "job" else
                    job.signal_rank(fault.rank, signum))
            if sent:
                self._fired(record, time.time())
            return
        if not job.signal_rank(fault.rank, signal.SIGKILL):  # the prelude: a stop
            return
        if kind.where == "load":
            self._write_armed(fault, 0)
            record.state = "prelude"
            return
        self._fired(record, time.time())
        record.hit = damage(fault, self.save, self.dir / "data" / DATA_NAME, self.dir / "local")

    def _fired(self, record: Record, stamp: float) -> None:
        record.fired_at, record.state = stamp, "fired"
        record.durable = tracked_iteration(self.save)

    # ------------------------------------------------------------------ between attempts

    def _between_attempts(self) -> bool:
        """Whether to requeue: after a fault the restart policy is to survive, or once the
        fix for a damaged file is applied (the job stopped with an error naming it)."""
        record = self.current()
        if record is None or record.state not in ("fired", "resumed"):
            return True
        fault = self.faults[self.i]
        if fault.kind.recovers or record.fixed is not None:
            return True
        if not names_fault(record, fault):
            # Damaged after the prelude stopped the job: a restart must meet it first
            # (torchrun's own restarts have, a requeue has not).
            record.requeued, requeue = True, not record.requeued
            return requeue
        record.fixed = fix(fault, record, self.save, self.dir / "data" / DATA_NAME, self.data)
        return True


def damage(fault: Fault, save: Path, data: Path, local: Path | None = None) -> str | None:
    """Corrupt, truncate or delete a file of the tracked checkpoint, the tracker, a dataset
    file, or flip a bit of the newest local checkpoint's; returns its path."""
    rng = random.Random(fault.pick)
    name = fault.kind.name
    if fault.kind.where in ("bin", "idx"):
        path = data.with_suffix("." + fault.kind.where)
    elif fault.kind.where == "tracker":
        path = save / TRACKER_FILENAME
    else:
        newest = (max(local.glob("iter_*"), default=None) if fault.kind.where == "local"
                  else tracked_checkpoint(save)[1])
        # Whole files only: a local save the SIGKILL cut short left a `.tmp`, never read.
        files = sorted(f for f in newest.iterdir() if not f.name.endswith(".tmp")) \
            if newest is not None else []
        if not files:
            return None  # no local checkpoint yet: nothing to damage
        path = files[int(fault.pick * len(files))]
    size = path.stat().st_size
    if size == 0 and not name.startswith("delete"):
        return None  # an empty tracker: nothing to truncate or flip
    if name.startswith("delete"):
        path.unlink()
    elif name.startswith("truncate"):
        os.truncate(path, int(rng.random() * size))
    elif name == "garble_tracker":
        path.write_bytes(rng.choice([b"", b"\x00\x17garbage", b"9999999", b"4\n2"]))
    else:
        offset = int(rng.random() * size)
        flipped = bytearray(path.read_bytes())
        flipped[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(flipped)
    return str(path)


def names_fault(record: Record, fault: Fault) -> bool:
    """Whether an error printed after the fault names it (the file, or rank and step)."""
    text = "\n".join(record.errors)
    if fault.kind.name == "nan_grad":
        return f"iteration {record.hook_iteration}: a gradient is NaN or infinite on " \
               f"rank(s) [{fault.rank}]" in text
    if fault.kind.name == "disk_full":
        return f"error (rank {fault.rank})" in text and "File too large" in text
    return record.hit is not None and Path(record.hit).name in text


def fix(fault: Fault, record: Record, save: Path, data: Path, pristine: Path) -> str:
    """What docs/troubleshooting.md tells the user to do for the damage `record.hit`."""
    hit = Path(record.hit)
    if fault.kind.where in ("bin", "idx"):
        shutil.copy(pristine.with_suffix(hit.suffix), hit)
        return f"restored {hit.name} from its source"
    removed = ""
    if hit.name != TRACKER_FILENAME:
        shutil.rmtree(hit.parent)
        removed = f"removed {hit.parent.name}, "
    whole = sorted((int(d.name[5:]) for d in save.iterdir()
                    if _ITER_DIR.fullmatch(d.name) and _readable(d)), reverse=True)
    if whole:
        (save / TRACKER_FILENAME).write_text(str(whole[0]))
        return f"{removed}tracker set to iteration {whole[0]}"
    (save / TRACKER_FILENAME).unlink(missing_ok=True)
    return f"{removed}no whole checkpoint left: tracker removed (a fresh start)"


def tracked_iteration(save: Path) -> int | None:
    """The tracker's iteration, None without a readable tracker."""
    try:
        return tracked_checkpoint(save)[0]
    except CheckpointError:
        return None


def _readable(directory: Path) -> bool:
    try:
        read_metadata(directory)
        return True
    except CheckpointError:
        return False
