"""What the checks of gpu_check.sh share: launching pretrain runs (one process, or under
torchrun), reading what they print (run_pretrain.py's ">>" reports), the memory planner's
figure for a run's flags, and collecting the checks' verdicts. Results are printed as
">> ok  | BAD  name: detail" lines."""

import json
import os
import re
import subprocess
import sys
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
    # One rank on a CPU is the same gloo world of one with or without torchrun (pretrain()
    # makes it); torchrun's agent would only add a process start to each of SMOKE's runs.
    torchrun = nproc > 1 or (nproc == 1 and GPU)
    command = (torchrun_command(nproc, script, args) if torchrun
               else [sys.executable, script, *args])
    # Deterministic cuBLAS (run_pretrain --deterministic): its workspace must be fixed.
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", **(env or {}))
    with open(log, "w") as out:
        rc = subprocess.run(command, cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    return rc, open(log, errors="replace").read()


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
