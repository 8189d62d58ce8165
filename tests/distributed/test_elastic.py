"""Elastic membership (issue 17): two torchrun agents (`--nnodes 1:2`, c10d rendezvous on
loopback, one process each) train together; one agent is killed mid-run; the survivor's
worker restarts at world size 1, resumes from the last checkpoint with DP recomputed and
the same global batch, logs its recovery time, and ends with exactly the losses of a
straight run resumed from that checkpoint at that size.

The store is tools/rendezvous_store.py's, in a process of its own, and both agents run
with is_host=0 (issue 30): the agent killed is the one the README's simpler launch would
host the store in, whose loss ends every agent of that launch."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.checkpointing.storage import TRACKER_FILENAME, checkpoint_dir, read_metadata
from megalite.network import free_port
from megalite.training_log import parse_log

from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--distributed-backend", "gloo", vocab_size=61,
                   make_vocab_size_divisible_by=None, hidden_size=32, seq_length=16,
                   micro_batch_size=1, global_batch_size=4, train_iters=80)


def start_agent(port: int, save: Path, host_store: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "megalite-elastic",
               "--rdzv-conf", f"is_host={int(host_store)},last_call_timeout=2",
               "--max-restarts", "3", "pretrain_gpt.py", *FLAGS, "--save", str(save),
               "--load", str(save), "--save-interval", "5"]
    return subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill_node(agent: subprocess.Popen):
    """SIGKILL an agent and its workers, as losing their node does (torchrun starts each
    worker in a session of its own, so the agent's process group does not hold them)."""
    workers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == agent.pid:
                    workers.append(int(pid))
        except (OSError, ValueError):
            continue
    for pid in [agent.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def losses(text: str) -> dict[int, str]:
    return {log["iteration"]: log["lm_loss"] for log in parse_log(text)}


def start_store(port: int) -> subprocess.Popen:
    store = subprocess.Popen([sys.executable, "tools/rendezvous_store.py", "--port", str(port)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    line = store.stdout.readline()
    assert "listening" in line, (line, store.stderr.read() if store.poll() else "")
    return store


def test_killed_agent_survivor_resumes_at_half_the_world_size(tmp_path):
    save, port = tmp_path / "ckpt", free_port()
    store = start_store(port)
    doomed = start_agent(port, save, host_store=False)  # the simpler launch's $HEAD
    survivor = start_agent(port, save, host_store=False)
    try:
        deadline = time.monotonic() + 120
        while not (save / TRACKER_FILENAME).exists():
            assert survivor.poll() is None and time.monotonic() < deadline, \
                survivor.communicate()
            time.sleep(0.05)
        kill_node(doomed)
        out, err = survivor.communicate(timeout=240)
    finally:
        for agent in (survivor, doomed):
            if agent.poll() is None:
                kill_node(agent)
        store.terminate()
        store.wait(timeout=30)
    assert survivor.returncode == 0, err[-3000:]
    resumed = re.findall(r"resuming from \S+ at iteration (\d+)", out)
    assert resumed, "the survivor never restarted (did the kill come after the end?)"
    k = int(resumed[-1])
    # Checkpoint k was written by the two-process world, the last one by the survivor alone
    # (DP recomputed from the world size); the global batch is the flag's either way.
    for iteration, world in ((k, 2), (80, 1)):
        layout = read_metadata(checkpoint_dir(save, iteration))["layout"]
        assert (layout["world_size"], layout["data_parallel_size"]) == (world, world)
    after = out.rsplit("resuming from", 1)[1]
    recovery = re.search(r"recovery time: ([\d.]+) s", after)
    assert recovery, after[:2000]
    print(f"elastic restart at world size 1 from iteration {k}: recovery time "
          f"{recovery[1]} s from the new worker's start")

    # The reference: one process, straight from a copy of checkpoint k.
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copytree(checkpoint_dir(save, k), checkpoint_dir(reference, k))
    (reference / TRACKER_FILENAME).write_text(str(k))
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--load",
                           str(reference)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = losses(proc.stdout)
    assert sorted(expected) == list(range(k + 1, 81))
    assert losses(after) == expected
