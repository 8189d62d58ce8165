"""This rank's memory, in bytes: the CUDA caching allocator's counters on a GPU
(allocated by tensors, reserved from the driver, peak allocated: Megatron's
report_memory), the process's resident set on a CPU (now and its peak)."""

import os
import resource
import sys

import torch


def memory_fields(device: torch.device) -> tuple[str, ...]:
    """The names memory_stats reports on `device`, in a fixed order (the same on every
    rank, so ranks can stack them)."""
    if device.type == "cuda":
        return ("allocated", "reserved", "max allocated")
    return ("RSS", "max RSS")


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "max allocated": torch.cuda.max_memory_allocated(device)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    now = _resident_bytes() or peak
    # The kernel updates the peak lazily: never report it below the current value.
    return {"RSS": now, "max RSS": max(now, peak)}


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
