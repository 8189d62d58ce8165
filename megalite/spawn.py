"""Run a function on N local ranks and collect what each returns: how tests and benchmarks
launch ranks (training itself is launched by torchrun).

    results = run_distributed(world_size, fn, *args, timeout=120)

starts `world_size` processes; each joins a process group (gloo on the CPU; NCCL with
`device_type="cuda"`, rank r on GPU r) through a file:// rendezvous in a fresh temporary
directory, runs `fn(rank, world_size, *args)` with one intra-op thread, and destroys the
group. `fn` must be a module-level function of an importable module (or of the script
being run): it is pickled by name. Returns each rank's return value (picklable), indexed
by rank.

Ranks start from a "forkserver": one clean process, started at the first launch, that has
imported torch and megalite's training stack and forks every rank of every later launch.
Under "spawn" each rank re-imports them (seconds per rank on a small machine: most of a
test's time); a plain "fork" of the caller would copy whatever threads and state it has.
The ranks see the environment as it was when the server started.

A rank that raises makes run_distributed raise RankFailure with that rank's traceback; the
other ranks are killed at once (they would otherwise wait forever in a collective). A run
past `timeout` seconds (None: no limit) is killed and raises, naming the ranks still
running.

Where training must be launched as users launch it, `torchrun_command` is the one torchrun
command line, and `torchrun_workers` finds its workers (to kill one).
"""

import contextlib
import datetime
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the forkserver imports once for every rank it forks (names, not imports: the server
# imports them; megalite.training pulls in the model, the parallel layers and the data;
# torch.optim.Optimizer's constructor imports torch._dynamo, ~1.5 s a rank, and it starts
# no thread, so it forks safely).
FORKSERVER_PRELOAD = ["torch", "megalite.training", "torch._dynamo"]


class RankFailure(AssertionError):
    """A rank raised, crashed or hung (an AssertionError, so a test using it fails)."""


def _join_group(rank, world_size, workdir, timeout, device_type):
    torch.set_num_threads(1)
    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if device_type == "cuda":  # gpu_check: gpu_tests
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        options["device_id"] = device
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world_size, **options)


def _worker(rank, world_size, workdir, timeout, device_type, fn, args):
    # What a rank starts itself (the DataLoader's --num-workers) forks from it, as under
    # torchrun on Linux; a rank inherits "forkserver", whose fresh server would re-import
    # torch and the caller's module for every worker (seconds each, on every launch).
    multiprocessing.set_start_method("fork", force=True)
    try:
        _join_group(rank, world_size, workdir, timeout, device_type)
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        Path(workdir, f"result{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(workdir, f"error{rank}.txt").write_text(traceback.format_exc())
        # Exit without running exit handlers: they could block on a peer stuck in a
        # collective, and the parent is about to kill the peers anyway.
        os._exit(1)


def run_distributed(world_size: int, fn, *args, timeout: float | None = 120,
                    device_type: str = "cpu", start_method: str = "forkserver") -> list:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # ignored once the server runs
    with tempfile.TemporaryDirectory(prefix="megalite-dist-") as workdir:
        procs = [ctx.Process(target=_worker, args=(rank, world_size, workdir, timeout,
                                                   device_type, fn, args))
                 for rank in range(world_size)]
        try:
            for p in procs:
                p.start()
            _wait_for_first_failure(procs, deadline=None if timeout is None
                                    else time.monotonic() + timeout)
        finally:
            killed = [rank for rank, p in enumerate(procs) if p.exitcode is None]
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
                if p.pid is not None:
                    p.join()
        _raise_failures(procs, workdir, killed, f"{fn.__name__} on {world_size} ranks",
                        timeout)
        return [pickle.loads(Path(workdir, f"result{rank}.pkl").read_bytes())
                for rank in range(world_size)]


def _raise_failures(procs, workdir: str, killed: list[int], what: str, timeout):
    errors = []
    for rank, p in enumerate(procs):
        path = Path(workdir, f"error{rank}.txt")
        if path.exists():
            errors.append((path.stat().st_mtime, f"--- rank {rank} raised:\n{path.read_text()}"))
        elif p.exitcode != 0 and rank not in killed:
            errors.append((0.0, f"--- rank {rank} died with exit code {p.exitcode}"))
    if errors:
        # Earliest first: a peer's later error is usually a consequence (closed connection).
        raise RankFailure(f"{what} failed (killed: ranks {killed}):\n"
                          + "\n".join(text for _, text in sorted(errors, key=lambda e: e[0])))
    if killed:
        raise RankFailure(f"{what} timed out after {timeout} s; still running: ranks {killed}")


def _wait_for_first_failure(procs, deadline: float | None):
    """Return when every process has exited, one has failed, or the deadline passed."""
    while True:
        running = [p for p in procs if p.exitcode is None]
        if not running or any(p.exitcode for p in procs) or \
                (deadline is not None and time.monotonic() > deadline):
            return
        multiprocessing.connection.wait(
            [p.sentinel for p in running],
            timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))


def torchrun_launcher(nproc: int, max_restarts: int | None = None) -> list[str]:
    """The launcher part of a one-node torchrun on `nproc` workers, up to the script, through
    this interpreter (`python -m torch.distributed.run`: no PATH lookup)."""
    restarts = [] if max_restarts is None else ["--max-restarts", str(max_restarts)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), *restarts]


# What torchrun hands its workers. A launch made from inside one (the chaos job's agents, the
# cluster check's recovery run) drops them, or its own torchrun would join the outer job.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                "MASTER_PORT")


def outside_launcher(env) -> dict:
    """`env` without torchrun's variables (LAUNCHER_ENV and TORCHELASTIC_*)."""
    return {k: v for k, v in env.items()
            if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}


def torchrun_command(nproc: int, script: str, args=(), max_restarts: int | None = None
                     ) -> list[str]:
    """The command line of a one-node torchrun of `script` with `args` on `nproc` workers."""
    return [*torchrun_launcher(nproc, max_restarts), script, *args]


def process_environments():
    """(pid, environment) of every process whose environment this one may read, from /proc
    (Linux)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        yield int(pid), env


def process_parent(pid: int) -> int:
    """The parent's pid of `pid`, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of a torchrun agent's workers (its children with LOCAL_RANK set), read
    from /proc (Linux): how a test or the cluster check kills one rank of a live job."""
    workers = {}
    for pid, env in process_environments():
        with contextlib.suppress(OSError):
            if b"LOCAL_RANK" in env and process_parent(pid) == agent_pid:
                workers[int(env[b"LOCAL_RANK"])] = pid
    return workers
