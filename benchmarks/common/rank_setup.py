"""What the multi-process benchmarks share: the --device flag, how ranks start, and a rank's
device (megalite.spawn.run_distributed launches them: NCCL and GPU `rank` on cuda, gloo on
the CPU)."""
import argparse
import time

import torch

from megalite.spawn import run_distributed


def add_device_flag(parser: argparse.ArgumentParser):
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")


def describe(device_type: str) -> str:
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    return f"{gpus} GPU(s), NCCL" if gpus else "the CPU, gloo"


def rank_device(rank: int, device_type: str) -> torch.device:
    """The device of `rank` under megalite.spawn.run_distributed: GPU `rank` on cuda."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def launch(world: int, fn, *args, device_type: str = "cpu") -> list:
    """fn(rank, world, *args) on `world` ranks of `device_type`; each rank's return value.
    No time limit: a measurement takes as long as it takes."""
    return run_distributed(world, fn, *args, timeout=None, device_type=device_type)


def synced_clock(device: torch.device) -> float:
    """perf_counter after the device's queued work (kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def slow_down(module, seconds: float):
    """A test-only delay: `module` sleeps `seconds` before each forward, leaving the CPU
    to the other ranks (a slow device of its own, as the --log-straggler tests make one)."""
    forward = module.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)
    module.forward = slow_forward


def require_ranks(device_type: str, world: int):
    """Under NCCL each rank needs a GPU of its own."""
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"--device cuda needs {world} GPUs (one rank per GPU under NCCL)")
