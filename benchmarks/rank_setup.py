"""What the multi-process benchmarks share: the --device flag, how ranks start, and a rank's
device (megalite.spawn.run_distributed launches them: NCCL and GPU `rank` on cuda, gloo on
the CPU)."""
import argparse

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
