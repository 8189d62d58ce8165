"""examples/slurm/train_gpt.sbatch on a real one-node Slurm cluster on loopback.

The session fixture starts munged, slurmctld and slurmd with .ci/slurm/start_cluster.sh
(Debian's slurm-wlm and munge, installed by .ci/slurm/install.sh) and stops them at the
end. Each test submits the example script unchanged, overriding by environment only what a
user would: a tiny model on the CPU, two processes on one node, no GPU request, and a
checkpoint directory of its own.

Without Slurm the tests are skipped; under CI (CI=true) a missing or broken Slurm fails.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train_gpt.sbatch"
CLUSTER_DIR = os.environ.get("MEGALITE_SLURM_DIR", "/tmp/megalite-slurm")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}

# What a user overrides to run the example on a laptop: 2 CPU processes (gloo, DP 2 with
# the script's default ZeRO-1 layout), a 2-layer model on Megatron's mock data.
TINY_CPU_RUN = {
    "NPROC_PER_NODE": "2",
    "MODEL_ARGS": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                  "--seq-length 32 --max-position-embeddings 32",
    "TRAINING_ARGS": "--micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3",
    "DATA_ARGS": "--mock-data --vocab-size 64 --make-vocab-size-divisible-by 64",
    "LOGGING_ARGS": "--log-interval 5 --eval-interval 10 --eval-iters 2",
}
# The #SBATCH lines ask for 2 nodes of 8 GPUs and 32 CPUs; this cluster is one 2-CPU node.
TINY_CPU_OPTIONS = ["--nodes=1", "--gpus-per-node=0",
                    f"--cpus-per-task={len(os.sched_getaffinity(0))}",
                    "--time=10"]


def _fail_or_skip(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: .ci/run must install and start Slurm)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_conf():
    """SLURM_CONF of a running one-node cluster; left running if it was up before."""
    if shutil.which("sbatch") is None:
        _fail_or_skip("Slurm is not installed (no sbatch); .ci/slurm/install.sh installs it")
    start = subprocess.run(["bash", str(REPO / ".ci/slurm/start_cluster.sh"), CLUSTER_DIR],
                           capture_output=True, text=True, timeout=120, check=False)
    if start.returncode != 0:
        _fail_or_skip(f"the Slurm cluster did not start:\n{start.stdout}{start.stderr}")
    yield os.path.join(CLUSTER_DIR, "slurm.conf")
    if "reusing" not in start.stdout:
        subprocess.run(["bash", str(REPO / ".ci/slurm/stop_cluster.sh"), CLUSTER_DIR],
                       capture_output=True, timeout=60, check=False)


def job_environment(slurm_conf: str, overrides: dict) -> dict:
    # Nothing from an enclosing Slurm job: sbatch would read its options from there.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(SLURM_CONF=slurm_conf, GLOO_SOCKET_IFNAME="lo",
               # torchrun of this Python, whatever `torchrun` on PATH is.
               TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    # The rendezvous host is the node's name; keep all traffic on loopback.
    if not socket.gethostbyname(socket.gethostname()).startswith("127."):
        env["MASTER_ADDR"] = "127.0.0.1"
    env.update(overrides)
    return env


def submit(env: dict, log: Path, *options: str) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", *TINY_CPU_OPTIONS, *options, str(SCRIPT)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job(env: dict, job_id: str) -> dict:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_until(env: dict, job_id: str, log: Path, done, what: str, timeout: float = 180):
    """Poll the job until done(job dict, log text); on timeout cancel it and fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info, text = job(env, job_id), log.read_text() if log.exists() else ""
        if done(info, text):
            return info, text
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, timeout=30, check=False)
    pytest.fail(f"job {job_id}: no {what} after {timeout} s (state "
                f"{info.get('JobState')}); its log:\n{text}")


def finished(info, text):
    return info["JobState"] in FINISHED


def assert_completed(info: dict, text: str):
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text


def iterations(text: str) -> list[int]:
    return [int(i) for i in re.findall(r" iteration +(\d+)/ *\d+ \|", text)]


def test_example_trains_and_checkpoints_on_two_cpu_processes(slurm_conf, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    env = job_environment(slurm_conf, dict(TINY_CPU_RUN, CHECKPOINT_DIR=str(checkpoints)))
    log = tmp_path / "train.out"
    job_id = submit(env, log)
    info, text = wait_until(env, job_id, log, finished, "end")

    assert_completed(info, text)
    assert "on 1 node(s)" in text and "x 2 processes" in text, text
    assert iterations(text) == [5, 10, 15, 20], text
    losses = [float(x) for x in re.findall(r"\| lm loss: (\S+) \|", text)]
    assert losses[-1] < losses[0] - 0.3, f"loss did not go down: {losses}"
    assert "validation loss at iteration 20" in text, text
    assert "successfully saved checkpoint at iteration      20" in text, text
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert "training step exited with 0" in text, text


def signal_save_requeue_resume(env, log, signal_at: int):
    """Submit, send USR1 to the batch shell (what --signal=B:USR1@T does at the time
    limit's warning) once iteration `signal_at` is logged, let the job save and requeue
    itself, and wait for the requeued run's end. Returns (job info, log text)."""
    job_id = submit(env, log)
    wait_until(env, job_id, log, lambda i, t: signal_at in iterations(t),
               f"iteration {signal_at}")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True,
                   timeout=30)
    info, _ = wait_until(env, job_id, log, lambda i, t: i["Restarts"] == "1" and
                         i["JobState"] == "PENDING" or i["JobState"] in FINISHED, "requeue")
    if info["JobState"] == "PENDING":
        # Slurm holds a requeued job 2 minutes. Start it sooner, but not within the second
        # its first run ended: slurmd would refuse the new launch as the old run's revoked
        # credential (it compares whole seconds) and fail the job.
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env,
                       timeout=30, check=False)
    return wait_until(env, job_id, log, finished, "end")


def assert_saved_and_resumed(info: dict, text: str, train_iters: int):
    assert_completed(info, text)
    assert info["Restarts"] == "1", text
    first_run, _, second_run = text.partition("(restart 1)")
    assert "USR1: asking the training processes to save and stop" in first_run, text
    saved = re.search(r"successfully saved checkpoint at iteration +(\d+)", first_run)
    assert saved, text
    saved_at = int(saved.group(1))
    assert "requeueing job" in first_run, text
    assert f"after iteration {saved_at}: received signal SIGUSR1" in first_run, text
    loaded = re.search(r"> resuming from .* at iteration (\d+)", second_run)
    assert loaded and int(loaded.group(1)) == saved_at, text
    # Every iteration once, the first run's up to the save, the second run's after it.
    assert iterations(first_run) == list(range(1, saved_at + 1)), text
    assert iterations(second_run) == list(range(saved_at + 1, train_iters + 1)), text


def test_usr1_saves_requeues_and_resumes(slurm_conf, tmp_path):
    """Preemption-safe training end to end: Slurm's warning signal -> every rank stops at
    one iteration and saves -> the job requeues itself -> the new run resumes there."""
    overrides = dict(TINY_CPU_RUN, CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
                     TRAINING_ARGS="--micro-batch-size 2 --global-batch-size 8 "
                                   "--train-iters 60 --lr 1e-3",
                     LOGGING_ARGS="--log-interval 1 --eval-interval 1000 --eval-iters 2")
    env = job_environment(slurm_conf, overrides)
    log = tmp_path / "train.out"
    info, text = signal_save_requeue_resume(env, log, signal_at=10)

    assert_saved_and_resumed(info, text, train_iters=60)
