"""A model, its optimizer and scheduler built from the flags as pretrain() builds them, in a
one-rank process group: what the checkpoint benchmarks (checkpoint_throughput.py,
async_save_stall.py) save and load."""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.checkpointing.state import CheckpointState, TrainState
from megalite.network import free_port
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.parallel_state import ParallelState
from megalite.train_step import StepRunner
from megalite.training import build_model, build_optimizer
from megalite.validation import validate_args

REPO = Path(__file__).resolve().parents[2]


class Run:
    """A model, its optimizer and scheduler, built from the flags as pretrain() builds them."""

    def __init__(self, config, state: ParallelState, device: torch.device):
        self.config, self.state, self.device = config, state, device
        self.model = build_model(config, state, device, None)
        self.optimizer, self.grad_buffer = build_optimizer(self.model, config, state)
        self.scheduler = LRScheduler(self.optimizer, config.scheduler)

    def train_step(self):
        m, t = self.config.model, self.config.training
        runner = StepRunner(self.model, self.optimizer, self.config, self.state, self.device,
                            self.grad_buffer)
        shape, device = (t.micro_batch_size, m.seq_length), self.device
        runner.train_step([{"tokens": torch.randint(0, m.vocab_size, shape, device=device),
                            "labels": torch.randint(0, m.vocab_size, shape, device=device),
                            "loss_mask": torch.ones(shape, device=device)}])
        self.scheduler.step(t.global_batch_size)

    def save(self, directory: str, iteration: int) -> Path:
        return save_checkpoint(directory, iteration, self.checkpoint(iteration))

    def load(self, directory: str):
        load_checkpoint(directory, self.checkpoint(0))

    def checkpoint(self, iteration: int) -> CheckpointState:
        return CheckpointState(self.model, self.optimizer, self.scheduler, self.state,
                               self.config, TrainState(iteration, iteration))


def build_config(args, save_dir: str):
    h = args.hidden_size
    return validate_args(parse_args([
        "--mock-data", "--vocab-size", str(args.vocab_size), "--num-layers", str(args.num_layers),
        "--hidden-size", str(h), "--num-attention-heads", str(h // 64),
        "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", "1", "--lr", "1e-4", "--save", save_dir, "--load", save_dir]), 1)


def add_run_args(p: argparse.ArgumentParser):
    """The model, device and directory flags."""
    p.add_argument("--dir", default=str(REPO),
                   help="Where the temporary directory goes (default: the repo's disk).")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="Where the model and optimizer live (default cuda:0 when a GPU is "
                        "visible).")


def init_one_rank(name: str) -> torch.device:
    """A one-rank process group on `name`'s device (NCCL on CUDA, else gloo)."""
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    return device
