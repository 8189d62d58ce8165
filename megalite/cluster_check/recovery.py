"""Recovery: rank 0 runs a torchrun of its own with --max-restarts 1, SIGKILLs one of its
workers after a checkpoint, and times from the kill to the first resumed step; it fails when
that step is not the one after the loaded checkpoint."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import torch.distributed as dist

from megalite.checkpointing.storage import TRACKER_FILENAME
from megalite.cluster_check.report import Section, table
from megalite.cluster_check.shared import ROOT, TARGETS, batch_flags
from megalite.spawn import outside_launcher, torchrun_command, torchrun_workers


class Child:
    """A torchrun of pretrain_gpt.py whose output lines are kept with their arrival time."""

    def __init__(self, command: list[str], env: dict):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0):
        """(arrival time, match) of the first line after `after` matching `pattern`."""
        for when, line in list(self.lines):
            match = re.search(pattern, line)
            if when >= after and match:
                return when, match
        return None

    def wait_for(self, condition, deadline: float):
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = condition()
            if found:
                return found
            time.sleep(0.05)
        return condition()

    def stop(self):
        """SIGTERM the agent (it stops its workers); SIGKILL all after 30 s."""
        if self.proc.poll() is None:
            workers = torchrun_workers(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *workers.values()]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(10)

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def recovery_command(model: list[str], nproc: int, directory: str) -> list[str]:
    return torchrun_command(nproc, os.path.join(ROOT, "pretrain_gpt.py"), [
        *model, *batch_flags(2 * nproc), "--save", directory, "--load", directory,
        "--save-interval", "3", "--log-interval", "1", "--eval-iters", "0"], max_restarts=1)


def time_recovery(model: list[str], nproc: int, directory: str, limit: float) -> dict:
    """Train under torchrun --max-restarts 1, SIGKILL the last worker once a checkpoint is
    published, and time from the kill to the end of the first resumed iteration (the
    line training's monitor prints then). {"problem": text} when that does not happen."""
    env = outside_launcher(os.environ)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    child = Child(recovery_command(model, nproc, directory), env)
    try:
        tracker = os.path.join(directory, TRACKER_FILENAME)
        if not child.wait_for(lambda: os.path.exists(tracker), time.monotonic() + limit):
            return {"problem": "no checkpoint was published before the limit:\n" + child.tail()}
        killed = max(torchrun_workers(child.proc.pid).items())
        start = time.monotonic()
        os.kill(killed[1], signal.SIGKILL)
        resumed = child.wait_for(lambda: child.first(r"recovery time: ([\d.]+) s from process "
                                                     r"start .*\((\d+)\)", start),
                                 start + limit)
        if not resumed:
            return {"problem": f"no resumed iteration within {limit:.0f} s of the kill:\n"
                    + child.tail()}
        loaded = child.first(r"resuming from \S+ at iteration (\d+)", start)
        return {"seconds": resumed[0] - start, "worker_seconds": float(resumed[1][1]),
                "iteration": int(resumed[1][2]), "loaded": int(loaded[1][1]) if loaded else None,
                "killed": killed[0]}
    finally:
        child.stop()


def check_recovery(model: list[str], args, rank: int, world: int) -> Section:
    section = Section("Recovery: one rank killed, the job restarted from its checkpoint")
    nproc = args.recovery_nproc or min(2, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    directory = os.path.join(os.path.abspath(args.checkpoint_dir or args.output_dir),
                             "check-cluster-recovery")
    result = [None]
    if rank == 0:  # the other ranks wait (idle) in the broadcast
        shutil.rmtree(directory, ignore_errors=True)
        result[0] = time_recovery(model, nproc, directory, args.recovery_limit)
        shutil.rmtree(directory, ignore_errors=True)
    dist.broadcast_object_list(result, src=0)
    r = result[0]
    section.lines += [f"Rank 0 launched `torchrun --standalone --nproc-per-node {nproc} "
                      "--max-restarts 1 pretrain_gpt.py` (the check's model, a checkpoint "
                      "every 3 iterations), SIGKILLed one worker once a checkpoint was "
                      "published, and timed from the kill to the end of the first iteration "
                      "after the restart (torchrun noticing the death, stopping the others, "
                      "restarting every worker, the rendezvous, loading the checkpoint, one "
                      "step). A single-node restart: a lost node is the job scheduler's "
                      "requeue or torchrun's elastic rendezvous (README, \"Checkpoints: "
                      "save, resume, reshard, export\").",
                      ""]
    if "problem" in r:
        section.failed = True
        section.lines += ["**FAIL**: " + r["problem"].replace("\n", "  \n")]
        return section
    verdict = "meets" if r["seconds"] < TARGETS["recovery (s)"] else "misses"
    section.lines += table(["killed local rank", "resumed from iteration", "first resumed "
                            "iteration", "kill -> first resumed step (s)", "of which the "
                            "restarted worker's own (s)"],
                           [[r["killed"], r["loaded"], r["iteration"], f"{r['seconds']:.1f}",
                             f"{r['worker_seconds']:.1f}"]])
    section.lines += ["", f"{r['seconds']:.1f} s {verdict} the 5-minute recovery target."]
    if r["loaded"] is None or r["iteration"] != r["loaded"] + 1:
        section.failed = True
        section.lines += ["", f"**FAIL**: the first iteration after the restart is "
                          f"{r['iteration']}, not the one after the checkpoint loaded "
                          f"({r['loaded']})."]
    return section
