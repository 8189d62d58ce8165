"""What the checks of gpu_check.sh share: launching pretrain runs (one process, or under
torchrun), reading what they print (run_pretrain.py's ">>" reports), the memory planner's
figure for a run's flags, and collecting the checks' verdicts. Results are printed as
">> ok  | BAD  name: detail" lines."""

import json
import multiprocessing
import multiprocessing.connection
import os
import re
import runpy
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from megalite.arguments import parse_args
from megalite.memory_estimate import most_loaded_rank
from megalite.spawn import torchrun_command
from megalite.validation import validate_args

HELPERS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HELPERS))
GPU = torch.cuda.is_available()
SMOKE = os.environ.get("SMOKE") == "1"
# Several runs share the GPU at once (each its own one-rank NCCL group); on a CPU, one a core
# (CI's two: a run is mostly its imports, one core's work).
PARALLEL_RUNS = 4 if GPU else 2
# A tiny run on a CPU (SMOKE) is mostly an interpreter start and the imports of torch and
# megalite (~3 of its ~3.5 CPU seconds), so there each script runs in a fork of a server that
# imported them once, as megalite.spawn's ranks do: multiprocessing's forkserver,
# single-threaded and with no torch op run, so a fork is a fresh process but for the imports
# (torch._dynamo: the optimizer's constructor imports it). A GPU run starts its own interpreter.
FORKS = None if GPU else multiprocessing.get_context("forkserver")
if FORKS:
    FORKS.set_forkserver_preload(["benchmarks.gpu.run_pretrain", "torch._dynamo"])
_PROCESSES = threading.Lock()  # run_script's: PARALLEL_RUNS threads start and join processes


class Checks:
    """Named verdicts, printed as they come; `exit()` fails the process if one failed."""

    def __init__(self):
        self.failed = []

    def __call__(self, name: str, ok: bool, detail: str) -> bool:
        print(f">> {'ok  ' if ok else 'BAD '} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def exit(self):
        sys.exit(1 if self.failed else 0)


def run_pretrain(log: str, flags: list[str], *, nproc: int = 0,
                 instruments: tuple[str, ...] = ("--deterministic", "--report-optimizer"),
                 env: dict | None = None) -> tuple[int, str]:
    """run_pretrain.py (megalite's pretrain() with instruments) on `flags`, under torchrun
    with `nproc` processes if not 0; its output goes to `log`. Returns (exit code, output)."""
    script, args = os.path.join(HELPERS, "run_pretrain.py"), [*instruments, "--", *flags]
    # Deterministic cuBLAS (run_pretrain --deterministic): its workspace must be fixed.
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **(env or {})}
    # One rank on a CPU is the same gloo world of one with or without torchrun (pretrain()
    # makes it); torchrun's agent would only add a process start to each of SMOKE's runs.
    if nproc > 1 or (nproc == 1 and GPU):
        rc = run_command(log, torchrun_command(nproc, script, args), env)
    else:
        rc = run_script(log, script, args, env)
    return rc, open(log, errors="replace").read()


def run_script(log: str, script: str, args: list[str], env: dict | None = None) -> int:
    """`python script args` from the repository with `env` added, its output to `log`;
    forked from the server of imports on a CPU. Returns the exit code."""
    if FORKS is None:
        return run_command(log, [sys.executable, script, *args], env)
    process = FORKS.Process(target=_forked, args=(log, script, args,
                                                  dict(os.environ, **(env or {}))))
    # multiprocessing's Process is not thread-safe: start() polls every live child, and a
    # poll racing this thread's join for the exit code reads end of file instead (exit code
    # 255 for a run that ended well). Every start and every read of an exit code is locked.
    with _PROCESSES:
        process.start()
    multiprocessing.connection.wait([process.sentinel])
    with _PROCESSES:
        process.join()
    return process.exitcode


def run_command(log: str, command: list[str], env: dict | None) -> int:
    with open(log, "w") as out:
        return subprocess.run(command, cwd=REPO, env=dict(os.environ, **(env or {})),
                              stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode


def _forked(log: str, script: str, args: list[str], env: dict):
    """In the fork: what `python script args` would do, with `env` and output to `log`."""
    with open(log, "w") as out:
        os.dup2(out.fileno(), sys.stdout.fileno())
        os.dup2(out.fileno(), sys.stderr.fileno())
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    torch._logging._init_logs()  # TORCH_LOGS is read as torch is imported: read it again
    # PARALLEL_RUNS runs, one a core: with a thread a core each, OpenMP's waiting threads
    # spun against each other (a tiny step of 20 ms took 1.5 s).
    torch.set_num_threads(1)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def resumed_bit_exact(check: Checks, name: str, logs: tuple[str, str],
                      checkpoints: tuple[str, str]) -> bool:
    """compare_resume.py on a straight run and the run resumed from its save: the logs'
    iterations and the final checkpoints' tensors, bit-exact; its lines printed here."""
    log = logs[1].removesuffix(".log") + ".compare.log"
    rc = run_script(log, os.path.join(HELPERS, "compare_resume.py"), [*logs, *checkpoints])
    print(open(log, errors="replace").read(), end="", flush=True)
    return check(f"{name}: save and resume", rc == 0,
                 "bit-exact against the straight run (the lines above)")


def run_all(jobs: dict, parallel: int = PARALLEL_RUNS) -> dict:
    """{name: (rc, output)} of {name: zero-argument callable}, `parallel` at a time."""
    with ThreadPoolExecutor(parallel) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def reports(text: str, what: str) -> list[dict]:
    """run_pretrain.py's JSON reports ">> {what}: {...}" in a run's output."""
    return [json.loads(m) for m in re.findall(rf"^>> {re.escape(what)}: (\{{.*\}})$", text,
                                              re.MULTILINE)]


def peak_gib(text: str) -> float | None:
    """The peak GPU memory allocated that run_pretrain.py reports (None on a CPU)."""
    m = re.search(r"max_memory_allocated\): ([\d.]+) GiB", text)
    return float(m.group(1)) if m else None


def planned_bytes(flags: list[str], world_size: int = 1) -> int:
    """The memory planner's bytes for the most loaded rank under CUDA's kernels."""
    return most_loaded_rank(validate_args(parse_args(flags), world_size), "cuda").total


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])
