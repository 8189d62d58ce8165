"""Run a test function on N gloo processes and fail the calling test if any rank fails.

    results = run_distributed(world_size, fn, *args, timeout=120)

spawns `world_size` processes; each joins a gloo process group (file:// rendezvous in a
fresh temp dir), runs `fn(rank, world_size, *args)` with one intra-op thread, and destroys
the group. `fn` must be a module-level function of an importable module (spawn pickles it
by name; the children inherit the parent's sys.path). Returns each rank's return value
(picklable), indexed by rank.

A rank that raises fails the test with that rank's traceback; the other ranks are killed at
once (they would otherwise wait forever in a collective). A run past `timeout` seconds is
killed and fails the test, naming the ranks still running.
"""

import datetime
import multiprocessing.connection
import os
import pickle
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class DistributedTestFailure(AssertionError):
    """A rank raised, crashed or hung."""


def _worker(rank, world_size, workdir, timeout, fn, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        with open(f"{workdir}/result{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(f"{workdir}/error{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        # Exit without running exit handlers: they could block on a peer stuck in a
        # collective, and the parent is about to kill the peers anyway.
        os._exit(1)


def run_distributed(world_size: int, fn, *args, timeout: float = 120):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megalite-dist-") as workdir:
        procs = [ctx.Process(target=_worker, args=(rank, world_size, workdir, timeout, fn, args))
                 for rank in range(world_size)]
        try:
            for p in procs:
                p.start()
            _wait_for_first_failure(procs, deadline=time.monotonic() + timeout)
        finally:
            killed = [rank for rank, p in enumerate(procs) if p.exitcode is None]
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
                if p.pid is not None:
                    p.join()

        errors = []
        for rank, p in enumerate(procs):
            path = f"{workdir}/error{rank}.txt"
            if os.path.exists(path):
                with open(path) as f:
                    errors.append((os.path.getmtime(path), f"--- rank {rank} raised:\n{f.read()}"))
            elif p.exitcode != 0 and rank not in killed:
                errors.append((0.0, f"--- rank {rank} died with exit code {p.exitcode}"))
        if errors:
            # Earliest first: a peer's later error is usually a consequence (closed connection).
            raise DistributedTestFailure(
                f"{fn.__name__} failed on {world_size} ranks (killed: ranks {killed}):\n"
                + "\n".join(text for _, text in sorted(errors, key=lambda e: e[0])))
        if killed:
            raise DistributedTestFailure(f"{fn.__name__} timed out after {timeout} s on "
                                         f"{world_size} ranks; still running: ranks {killed}")
        results = []
        for rank in range(world_size):
            with open(f"{workdir}/result{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _wait_for_first_failure(procs, deadline: float):
    """Return when every process has exited, one has failed, or the deadline passed."""
    while True:
        running = [p for p in procs if p.exitcode is None]
        if not running or any(p.exitcode for p in procs) or time.monotonic() > deadline:
            return
        multiprocessing.connection.wait([p.sentinel for p in running],
                                        timeout=max(0.0, deadline - time.monotonic()))
