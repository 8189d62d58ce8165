"""Process start-up choices that do not need a GPU to check."""

import multiprocessing as mp
import os
import socket

import pytest
import torch
import torch.distributed as dist

from megalite.config import DistributedConfig
from megalite.initialize import allow_tf32, initialize_distributed


def test_tf32_only_for_cuda_devices():
    """fp32 matmuls go to TF32 on CUDA (as in NVIDIA's containers), never on the CPU."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        allow_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        allow_tf32(torch.device("cuda", 0))  # a device object needs no GPU
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def _torchrun_worker(rank: int, restart_count: int, port: int, results):
    """What torchrun gives a worker whose agent hosts the store (the default), then a sum."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(restart_count))
    initialize_distributed(DistributedConfig(backend="gloo", timeout_minutes=0.1))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    results.put(total.item())
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_torchrun_round_meets_whatever_the_restart_counts_and_the_store_holds():
    """Workers on an agent store that outlived an earlier round, as torchrun keeps it
    (here holding that round's entry: a store that died with it), whose agents' restart
    counts differ (elastic: one agent restarted for its worker's failure, the other for
    the membership change, which counts no restart). They meet and sum; before, they
    waited for each other under different prefixes until the timeout."""
    agent_store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    with socket.socket() as s:  # a port nothing listens on any more
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    agent_store.set("megalite/round_store", f"{dead_port} 0123456789abcdef")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_torchrun_worker, args=(rank, count, agent_store.port,
                                                        results))
             for rank, count in ((0, 1), (1, 0))]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [3.0, 3.0]
