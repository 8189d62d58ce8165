"""Process start-up: the process group, this rank's device, and the seeds.

The same code runs under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK in the
environment) and as a plain `python pretrain_gpt.py` (a one-rank group on loopback).
"""

import datetime
import os
import random
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from megalite.config import DistributedConfig
from megalite.errors import ConfigError
from megalite.network import free_port


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize_distributed(config: DistributedConfig) -> tuple[int, int, torch.device]:
    """Init the default process group; returns (rank, world size, device)."""
    # 'cuda' (or another accelerator's device type) when one is visible.
    # gpu_check: torchrun_nccl
    accel = (torch.accelerator.current_accelerator().type
             if torch.accelerator.is_available() else None)
    backend = config.backend or ("nccl" if accel else "gloo")
    if backend == "nccl" and accel is None:
        raise ConfigError("--distributed-backend nccl needs a GPU and none is visible; "
                          "use --distributed-backend gloo to train on the CPU")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device(accel, int(os.environ.get("LOCAL_RANK", "0")))
        # In torch since 2.6 (pytorch#143186 renamed set_device_idx for the 2.6 release).
        torch.accelerator.set_device_index(device.index)
        allow_tf32(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=config.timeout_minutes)
        # Without torchrun's environment, a one-rank group on a free loopback port.
        where = _round_store(timeout) or ({} if "RANK" in os.environ else dict(
            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1))
        dist.init_process_group(backend, timeout=timeout,
                                device_id=device if backend == "nccl" else None, **where)
    return dist.get_rank(), dist.get_world_size(), device


def allow_tf32(device: torch.device):
    """fp32 matmuls on CUDA tensor cores in TF32 (10-bit mantissa, fp32 range and
    accumulation): 8x the fp32 rate on an H100. PyTorch leaves it off; Megatron-LM has no
    flag for it and runs in NVIDIA's containers, which turn it on for cuBLAS
    (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1). Set NVIDIA_TF32_OVERRIDE=0 to run in full fp32.
    bf16/fp16 runs are unaffected (their matmuls are half precision already)."""
    if device.type == "cuda":  # gpu_check: checkpoint_resume
        torch.set_float32_matmul_precision("high")


_ROUND_STORE, _NONCE = "megalite/round_store", "megalite/nonce"


def _round_store(timeout: datetime.timedelta) -> dict | None:
    """Under torchrun: a store of this round's own. When the agent hosts torchrun's store
    it outlives a round (a restart, an elastic membership change): a new worker would read
    the address a dead worker published there and fail to connect (gloo "connectFullMesh
    failed ... Connection refused"), and no number the workers are given tells them which
    round they are in (TORCHELASTIC_RESTART_COUNT is the agent's: an agent that restarts
    its workers for another node's failure keeps its count). So rank 0 hosts a new store
    and publishes its port and a nonce there; a stale entry names a store that died with
    its round (or another one on that port), and the others read again. When rank 0 hosts
    torchrun's store, it is new with the round already."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ["MASTER_ADDR"]
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    launcher = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world_size,
                             is_master=not agent_hosts_store and rank == 0, timeout=timeout)
    if not agent_hosts_store:
        store = launcher
    elif rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        nonce = uuid.uuid4().hex
        store.set(_NONCE, nonce)
        launcher.set(_ROUND_STORE, f"{store.port} {nonce}")
    else:
        store = _join_round_store(launcher, host, world_size, timeout)
    return dict(store=dist.PrefixStore("megalite", store), rank=rank, world_size=world_size)


def _join_round_store(launcher, host: str, world_size: int,
                      timeout: datetime.timedelta) -> dist.TCPStore:
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = launcher.get(_ROUND_STORE).decode().split()
        try:
            store = dist.TCPStore(host, int(port), world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=2))
            if store.check([_NONCE]) and store.get(_NONCE).decode() == nonce:
                store.set_timeout(timeout)
                return store
        except RuntimeError:  # refused: the store of a round that has ended
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {os.environ['RANK']}: rank 0 of this torchrun round "
                               f"published no live store on {host} within {timeout}")
        time.sleep(0.2)


def set_seed(seed: int):
    """Seed every generator training draws from (dropout, data shuffles in Python/NumPy).
    Weights do not depend on these: each parameter has its own generator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every accelerator device
