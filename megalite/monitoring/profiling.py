"""--profile: a torch.profiler trace of the steps --profile-step-start .. --profile-step-end
on the ranks --profile-ranks, as Megatron's --use-pytorch-profiler records it; on a GPU
--record-memory-history keeps the CUDA allocator's history from before the model is built
and writes a snapshot to --memory-snapshot-path (readable at pytorch.org/memory_viz) at the
profile's end, else after the first log interval, and when a step runs out of memory.

The trace is a Chrome trace JSON (TensorBoard's profiler plugin and Perfetto read it)
holding megalite's phases as named ranges (timers.py: forward-compute,
backward-compute, all-grads-sync, optimizer, pipeline-send-recv, ...) around torch's
own ops and each collective (gloo:all_reduce, nccl:all_reduce, ...).
"""

from pathlib import Path

import torch

from megalite.atomic_write import atomic_path
from megalite.errors import ConfigError
from megalite.timers import Timers


def rank_path(path: str, rank: int, world_size: int) -> Path:
    """`path`, with the rank before the suffix when several ranks write one."""
    p = Path(path)
    return p if world_size == 1 else p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


# gpu_check: memory_snapshot
def on_cuda(device: torch.device) -> bool:
    """Whether the CUDA allocator serves `device` (a CPU test stubs this, and the allocator)."""
    return device.type == "cuda"


def start_memory_history(config, device: torch.device):
    """--record-memory-history: the CUDA allocator records from here on. The run calls it
    before it builds the model, so a snapshot holds the parameters and optimizer state."""
    if not config.record_memory_history:
        return
    if not on_cuda(device):
        raise ConfigError("--record-memory-history records the CUDA allocator and needs a "
                          f"GPU; this run is on {device.type}")
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # gpu_check: memory_snapshot


class Profiler:
    """Iterations are counted as Megatron counts them: the profile starts before the
    step taken when `start` iterations are done and stops after iteration `end`, so it
    holds iterations start+1 .. end (as the log line numbers them)."""

    def __init__(self, config, rank: int, world_size: int, device: torch.device,
                 timers: Timers):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device, self.timers = device, timers
        self.enabled = config.profile and rank in config.profile_ranks
        self.profile = None
        self.snapshot_written = False

    def before_step(self, done: int):
        if self.enabled and done == self.config.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":  # gpu_check: train_350m
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities)
            self.profile.start()
            self.timers.profiling = True
            self.first = done + 1

    def after_step(self, done: int):
        if self.profile is not None and done == self.config.profile_step_end:
            self._finish(done)

    def close(self, done: int):
        """The run ended inside the window: write what was recorded."""
        if self.profile is not None:
            self._finish(done)

    def after_log_interval(self):
        """The snapshot a rank without a profile writes: once, after the first interval."""
        if not self.enabled and not self.snapshot_written:
            self.dump_memory_snapshot()

    def _finish(self, done: int):
        self.profile.stop()
        self.timers.profiling = False
        directory = Path(self.config.profile_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{self.rank}.iter{self.first}-{done}.pt.trace.json"
        with atomic_path(path) as staging:
            self.profile.export_chrome_trace(str(staging))
        self.profile = None
        print(f" > rank {self.rank}: profile of iterations {self.first}-{done} written to "
              f"{path}", flush=True)
        if self.config.record_memory_history:
            self.dump_memory_snapshot()

    def dump_memory_snapshot(self):
        if not self.config.record_memory_history:
            return
        path = rank_path(self.config.memory_snapshot_path, self.rank, self.world_size)
        with atomic_path(path) as staging:
            torch.cuda.memory._dump_snapshot(str(staging))  # gpu_check: memory_snapshot
        self.snapshot_written = True
        print(f" > rank {self.rank}: CUDA memory snapshot written to {path}", flush=True)
