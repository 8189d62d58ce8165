"""Time a layout's steps in processes of its own (tools/check_cluster.py's weak scaling and
--tune): every rank of the launch starts one process for the trial, those processes form a
process group of their own, and when the trial fails on one rank it ends on every rank at
once.

Why processes: a rank that runs out of memory in the middle of a step leaves its peers in a
collective it will never join. Nothing in their process can take them out of it (NCCL waits
for its timeout, 10 minutes by default, and then ends the process; aborting a gloo group
does not wake a waiting peer), but a process can be killed. The launcher of the rank whose
trial failed says so in a store that every rank's launcher watches; they all stop waiting
for their trial, agree on its result over the launch's own group (which never joined the
trial's collectives), and each kills its trial process, whose device memory goes with it.
A trial process never exits by itself, so a peer left in a collective with it waits, as
under NCCL, rather than fails: both backends take this one path. The tuner records the
layout as out of memory and goes on. Each trial also starts from an empty device, so the
memory it measures is its own.
"""

import datetime
import os
import socket
import statistics
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.arguments import parse_args
from megalite.layout_check import build_run
from megalite.timers import synchronize

# What the trial processes' forkserver imports once, not each trial (torch._dynamo: the
# optimizer's constructor imports it, ~1.5 s).
FORKSERVER_PRELOAD = ["torch", "megalite.layout_check", "torch._dynamo"]
FAILED = "failed"  # the store key a failed trial's launcher sets
POLL_S = 0.5  # how often a launcher looks at the store while its trial runs


@dataclass(frozen=True)
class TrialResult:
    """One rank's trial: its median seconds per step (None outside the layout, or when the
    trial failed here or was ended because it failed elsewhere), the most its memory grew,
    and why it failed here."""
    seconds: float | None = None
    peak_bytes: int = 0
    out_of_memory: str | None = None  # the error's first line
    error: str | None = None  # a traceback: any other failure


@dataclass(frozen=True)
class Trial:
    """The trial over all ranks: the slowest rank's median seconds per step and the most
    any rank's memory grew; or the first rank that ran out of memory, and its error."""
    seconds: float | None
    peak_bytes: int
    out_of_memory: tuple[int, str] | None = None


class PeakMemory:
    """The most this process's device memory grew inside the block: on GPUs the peak
    allocated above what was allocated at the start; on CPUs the resident set sampled
    every 2 ms above its size at the start."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, self._rss() - self.base)

    def __enter__(self):
        if self.device.type == "cuda":  # gpu_check: check_cluster_tune
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base, self._done = self._rss(), threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":  # gpu_check: check_cluster_tune
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._done.set()
            self._thread.join()


def time_layout(flags: list[str], world: int, rank: int, device: torch.device, steps: int,
                inject_out_of_memory: bool = False) -> Trial:
    """Median seconds per step of pretrain_gpt.py's `flags` on the first `world` ranks of
    the launch after one warm-up step, or the rank that ran out of memory. Every rank of
    the launch calls it together (the collectives here are the launch's); any other failure
    raises on every rank. `inject_out_of_memory`: this rank's trial raises
    torch.OutOfMemoryError in its first step, as a test's fault."""
    # Rank 0's store outlives its own trial: every rank is done with it after the gather.
    store, address = _trial_store(rank)
    mine, process = TrialResult(), None
    if rank < world:
        process, receiver = _start(address, flags, world, rank, device, steps,
                                   inject_out_of_memory)
        mine = _watch(process, receiver, store, rank)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    if process is not None:
        process.kill()
        process.join()
    peak = max(x.peak_bytes for x in results)
    # Out of memory first: it explains a peer's error (a process that died under it).
    for r, result in enumerate(results):
        if result.out_of_memory:
            return Trial(None, peak, (r, result.out_of_memory))
    for r, result in enumerate(results):
        if result.error is not None:
            raise RuntimeError(f"timing a layout ({' '.join(flags)}): rank {r} failed:\n"
                               f"{result.error}")
    return Trial(max(x.seconds for x in results if x.seconds is not None), peak)


def _trial_store(rank: int) -> tuple[dist.TCPStore, tuple[str, int]]:
    """A store for one trial, hosted by rank 0 on a free port, and its address."""
    if rank == 0:
        store = dist.TCPStore(socket.getfqdn(), 0, is_master=True, wait_for_workers=False)
    address = [(socket.getfqdn(), store.port) if rank == 0 else None]
    dist.broadcast_object_list(address, src=0)
    if rank != 0:
        store = dist.TCPStore(*address[0], is_master=False)
    return store, address[0]


def _start(address, flags, world, rank, device, steps, inject):
    """This rank's trial process, and the end of the pipe it sends its result down."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # ignored once the server runs
    if device.type == "cuda":  # gpu_check: check_cluster_tune
        torch.cuda.empty_cache()  # the launch's cached memory is the trial's to use
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_trial_process, daemon=True, args=(
        sender, address, dist.get_backend(), flags, world, rank, device, steps, inject,
        torch.get_num_threads(), torch.get_float32_matmul_precision()))
    process.start()
    sender.close()
    return process, receiver


def _watch(process, receiver, store, rank: int) -> TrialResult:
    """This rank's result, once its trial process sends it or dies, or another rank's
    trial failed; a failure here is told to the others."""
    result = None
    while result is None:
        if receiver.poll(POLL_S):
            result = receiver.recv()
        elif not process.is_alive():
            result = receiver.recv() if receiver.poll(0) else TrialResult(
                error=f"the trial process died with exit code {process.exitcode}")
        elif store.check([FAILED]):  # another rank's: this one's peers never finish
            result = TrialResult()
    if result.out_of_memory or result.error:
        store.set(FAILED, str(rank))
    return result


def _trial_process(conn, address, backend, flags, world, rank, device, steps, inject,
                   threads, matmul_precision):
    torch.set_num_threads(threads)  # as the launch's process runs
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        _join_trial_group(address, backend, flags, world, rank, device)
        result = _time_steps(flags, world, rank, device, steps, inject)
    except torch.OutOfMemoryError as e:  # torch.cuda.OutOfMemoryError is one
        result = TrialResult(out_of_memory=str(e).strip().splitlines()[0])
    except BaseException:
        result = TrialResult(error=traceback.format_exc())
    conn.send(result)
    threading.Event().wait()  # until the launcher kills this process (the module's why)


def _join_trial_group(address, backend: str, flags: list[str], world: int, rank: int,
                      device: torch.device):
    timeout = datetime.timedelta(minutes=parse_args(flags).distributed_timeout_minutes)
    store = dist.PrefixStore("group", dist.TCPStore(*address, is_master=False, timeout=timeout))
    options = {}
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
        options["device_id"] = device
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timeout, **options)


def _time_steps(flags, world, rank, device, steps, inject) -> TrialResult:
    with PeakMemory(device) as memory:
        config, _, model, optimizer, runner, batches = build_run(flags, world, rank, device)
        n, times = config.training.num_microbatches, []
        for _ in range(steps + 1):
            if inject:  # the peers are in the step's first collective by now, or soon
                raise torch.OutOfMemoryError("out of memory (injected: a test's fault)")
            start = time.perf_counter()
            runner.train_step([next(batches) for _ in range(n)])
            synchronize(device)
            times.append(time.perf_counter() - start)
    return TrialResult(statistics.median(times[1:]), memory.peak)
