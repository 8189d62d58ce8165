"""What the multi-process benchmarks share: the --device flag, how ranks start, and a rank's
device (megalite.spawn.run_distributed launches them: NCCL and GPU `rank` on cuda, gloo on
the CPU)."""
import argparse

import torch

from megalite.spawn import run_distributed
from smoke import ON as SMOKE


def add_device_flag(parser: argparse.ArgumentParser):
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")


def describe(device_type: str) -> str:
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    return f"{gpus} GPU(s), NCCL" if gpus else "the CPU, gloo"


def start_method(device_type: str) -> str:
    """How torch.multiprocessing starts the ranks: "fork" in SMOKE mode on the CPU, where
    "spawn" would re-import torch in every rank of every launch (seconds each on a shared
    2-core machine); "spawn" otherwise, as the measured runs were made (CUDA cannot fork)."""
    return "fork" if SMOKE and device_type == "cpu" else "spawn"


def rank_device(rank: int, device_type: str) -> torch.device:
    """The device of `rank` under megalite.spawn.run_distributed: GPU `rank` on cuda."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def launch(world: int, fn, *args, device_type: str = "cpu") -> list:
    """fn(rank, world, *args) on `world` ranks of `device_type`; each rank's return value.
    No time limit: a measurement takes as long as it takes."""
    return run_distributed(world, fn, *args, timeout=None, device_type=device_type,
                           start_method=start_method(device_type))
