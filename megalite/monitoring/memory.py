"""This rank's memory, in bytes: the CUDA caching allocator's counters on a GPU
(allocated by tensors, reserved from the driver, peak allocated: Megatron's
report_memory), the process's resident set on a CPU (now and its peak); and what autograd
saves for backward (SavedActivations)."""

import os
import resource
import sys

import torch


def memory_stats(device: torch.device) -> dict[str, float]:
    """By name, in an order fixed by the device type (the same on every rank, so ranks can
    stack them)."""
    if device.type == "cuda":  # gpu_check: train_350m
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


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd saves for backward inside `with`, each
    counted once: what a forward holds until its backward (the memory planner's activations
    are checked against it). A GPT chunk's parameters, buffers and RoPE table are the
    model's own, not activations; add() counts a tensor held outside autograd."""

    def __init__(self, chunk):
        rope_table = chunk.rope_table(next(chunk.parameters()).device)
        own = [*chunk.parameters(), *chunk.buffers(), *([] if rope_table is None
                                                        else [rope_table])]
        self.own = {t.untyped_storage().data_ptr() for t in own}
        self.saved = {}  # data_ptr -> tensor: held, so no storage is freed and reused
        super().__init__(self.add, lambda t: t)

    def add(self, *tensors: torch.Tensor) -> torch.Tensor:
        for t in tensors:
            if t.untyped_storage().data_ptr() not in self.own:
                self.saved[t.untyped_storage().data_ptr()] = t
        return tensors[0]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.saved.values())

    def __enter__(self):
        super().__enter__()
        return self
