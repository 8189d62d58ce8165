"""The Ray launch (megalite/ray_launch.py, tools/ray_launch.py) on a real local Ray
cluster: a head and a second node started as processes on 127.0.0.1, two ranks spread over
them, one killed by pid mid-run; Ray's launch restarts the group, which resumes from the
last checkpoint and finishes with the losses of an uninterrupted run."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megalite.checkpointing.storage import TRACKER_FILENAME
from megalite.network import free_port
from megalite.spawn import run_distributed
from megalite.training_log import parse_log

from tests.helpers import flags_with, load_tool, train_in_rank

ROOT = Path(__file__).resolve().parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--distributed-backend", "gloo", train_iters=40)


def ray_node(*flags, env) -> subprocess.Popen:
    """`ray start --block`: its daemons live as long as it does, and go when it is ended."""
    return subprocess.Popen(["ray", "start", "--block", "--node-ip-address", "127.0.0.1",
                             "--num-cpus", "1", "--disable-usage-stats", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_started(node: subprocess.Popen):
    for line in node.stdout:
        if "Ray runtime started" in line:
            # Drain the rest, or a full pipe would block the node's process.
            threading.Thread(target=node.stdout.read, daemon=True).start()
            return
    raise AssertionError(f"ray start exited with status {node.wait()}")


@pytest.fixture
def ray_cluster():
    pytest.importorskip("ray")
    """A head and a second node of one CPU each on 127.0.0.1, starting (the second waits
    for the head's GCS by itself); a function that waits for both and gives the address."""
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    nodes = [ray_node("--head", "--port", str(port), "--include-dashboard=false",
                      "--temp-dir", temp, env=env)]
    try:
        # On one host the nodes share the session's log directory: the head's log monitor
        # forwards every worker's lines (a second would forward each line twice).
        nodes.append(ray_node("--address", f"127.0.0.1:{port}", "--include-log-monitor=false",
                              env=env))

        def started() -> str:
            for node in nodes:
                wait_started(node)
            return f"127.0.0.1:{port}"
        yield started
    finally:
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)  # `ray start --block` stops its daemons
        for node in nodes:
            node.wait(timeout=60)
        subprocess.run(["rm", "-rf", temp])


def kill_rank_1_after_the_first_checkpoint(launcher, lines: list[str], save: Path):
    deadline = time.monotonic() + 180
    while not (save / TRACKER_FILENAME).exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.05)
    (pid,) = [int(line.split(" pid ")[1].split()[0]) for line in list(lines)
              if line.startswith("ray launch round 0: rank 1 ")]
    os.kill(pid, signal.SIGKILL)


def losses(out: str) -> dict[int, float]:
    return {log["iteration"]: log["lm_loss"] for log in parse_log(out)}


@pytest.mark.slow  # a Ray cluster and its workers are processes
def test_a_killed_worker_restarts_the_group_which_resumes_and_ends_as_if_never_stopped(
        ray_cluster, tmp_path):
    save = tmp_path / "ckpt"
    # The uninterrupted run (no Ray: two ranks of one process group) while Ray starts up.
    reference = {}
    uninterrupted = threading.Thread(target=lambda: reference.update(losses(
        run_distributed(2, train_in_rank, FLAGS, timeout=300)[1])))
    uninterrupted.start()
    launcher = subprocess.Popen(
        [sys.executable, "tools/ray_launch.py", "--address", ray_cluster(), "--num-workers", "2",
         "--max-failures", "1", "--", *FLAGS, "--save", str(save), "--load", str(save),
         "--save-interval", "5"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        kill_rank_1_after_the_first_checkpoint(launcher, lines, save)
        assert launcher.wait(timeout=240) == 0, "".join(lines)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    uninterrupted.join(timeout=300)
    assert "ray launch: rank " in out and "ray launch round 1: rank 1 " in out, out
    resumed_at = int(re.search(r"resuming from \S+ at iteration (\d+)", out)[1])
    assert 5 <= resumed_at < 40, out  # from a checkpoint, mid-run
    logged = parse_log(out)
    assert sorted(reference) == list(range(1, 41)) and logged[-1]["iteration"] == 40, out
    for log in logged:  # round 0's lines, then round 1's from its checkpoint on
        assert log["lm_loss"] == reference[log["iteration"]], log


def test_without_ray_the_error_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does when missing
    save = str(tmp_path / "ckpt")
    assert load_tool("ray_launch").main(["--num-workers", "2", "--", *FLAGS, "--save", save,
                                         "--load", save]) == 2
    assert "the Ray launch needs Ray: pip install 'megalite[ray]'" in capsys.readouterr().err


def test_a_launch_that_could_not_resume_is_refused(capsys):
    assert load_tool("ray_launch").main(["--num-workers", "2", "--", *FLAGS,
                                         "--save", "a"]) == 2
    assert ("give --save DIR and --load DIR, the same directory (got --save a, --load None)"
            in capsys.readouterr().err)
