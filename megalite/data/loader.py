"""This rank's micro-batches: the sampler's slice of every global batch, read and collated
(by --num-workers worker processes) ahead of the training loop."""

import signal

import torch

from megalite.config import Config
from megalite.data.sampler import CollateContextShard, MicroBatchSampler
from megalite.parallel_state import ParallelState


def microbatches(dataset, consumed_samples: int, config: Config, state: ParallelState,
                 device: torch.device, shares: tuple[int, ...] | None = None):
    """This DP rank's micro-batches from `consumed_samples` on, as tensors on `device`, each
    sequence cut to this CP rank's chunks. Worker processes (--num-workers) read and
    collate ahead of the training loop. `shares`: micro-batches per DP rank per global
    batch (default --data-parallel-shares as configured, else even)."""
    t = config.training
    sampler = MicroBatchSampler(len(dataset), consumed_samples, t.micro_batch_size,
                                state.dp_rank, state.dp_size, t.global_batch_size,
                                shares or t.data_parallel_shares)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler,
        collate_fn=CollateContextShard(state.cp_size, state.cp_rank, config.model.mtp_depths),
        num_workers=config.data.num_workers, pin_memory=device.type != "cpu",
        persistent_workers=config.data.num_workers > 0,
        worker_init_fn=_ignore_exit_signals if config.checkpoint.exit_signal_handler else None,
        # Its own generator: creating an iterator draws a seed, which from the global one
        # would shift every later dropout mask and break exact resume.
        generator=torch.Generator().manual_seed(config.training.seed))
    for batch in loader:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _ignore_exit_signals(_worker_id: int):
    """Slurm signals every process of the step; a loader worker started by spawn or
    forkserver would die of SIGUSR1. The training process alone acts on it."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
