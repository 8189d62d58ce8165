"""What the multi-process benchmarks share: the --device flag and one rank's process group
(NCCL and this rank's GPU on cuda, gloo on the CPU)."""
import argparse

import torch
import torch.distributed as dist

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


def init_rank(rank: int, world: int, store: str, device_type: str) -> torch.device:
    """Join the file-store process group as `rank`; returns the rank's device."""
    torch.set_num_threads(1)
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, device_id=device if cuda else None)
    return device
