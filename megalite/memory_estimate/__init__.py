"""Per-rank memory of a megalite training run, planned from its flags (issue 8).

`estimate_memory(config)` takes the validated `Config` and returns, for every pipeline
rank, the bytes one GPU of that rank holds at the peak of a training step: parameters,
gradient buffer, optimizer state and fp32 main grads (weights.py), and activations
(activations.py, walked through the schedule in schedule.py). docs/memory.md derives
what each column counts and what is left out.
"""

from dataclasses import dataclass

from megalite.config import Config
from megalite.memory_estimate.activations import DEVICES, rank_chunks  # noqa: F401
from megalite.memory_estimate.schedule import activation_bytes, microbatches_in_flight
from megalite.memory_estimate.checkpoint import checkpoint_bytes
from megalite.memory_estimate.weights import (num_model_parameters, rank_parameters,  # noqa: F401
                                              shard_numel, weights_and_optimizer)

GiB = 2 ** 30


@dataclass
class RankMemory:
    """Bytes one GPU of pipeline rank `pp_rank` (DP rank 0, any TP rank) holds at the peak."""
    pp_rank: int
    num_parameters: int
    parameters: int
    gradients: int
    optimizer_state: int
    """fp32 main parameters and Adam moments."""
    main_grads: int
    """fp32 copies of the owned gradients made by the optimizer step."""
    activations: int
    """Peak of saved activations + p2p send buffers + the recompute working set."""
    activations_per_microbatch: int
    """One micro-batch through every chunk of this rank, as saved for backward."""
    microbatches_in_flight: float
    """Most micro-batches whose backward has not run, in units of all v chunks."""
    p2p_buffers: int = 0
    """Part of `activations`: sent activations and gradients still held at its peak."""
    host: int = 0
    """Bytes in host memory, not in `total` (--optimizer-cpu-offload: the optimizer's
    shards of main parameters, moments and gradients)."""
    async_save_host: int = 0
    """Host buffers an --async-save keeps from save to save (checkpoint.py), not in `host`."""
    grad_compression: int = 0
    """PowerSGD's error buffers, last Qs and one bucket's P and Q
    (memory_estimate/grad_compression.py)."""

    @property
    def weights_and_optimizer(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.main_grads
                + self.grad_compression)

    @property
    def total(self) -> int:
        return self.weights_and_optimizer + self.activations


def estimate_memory(config: Config, device: str = "cuda") -> list[RankMemory]:
    """Memory of every pipeline rank (index = pipeline rank) at DP rank 0."""
    pp = config.parallel.pipeline_model_parallel_size
    return [estimate_rank_memory(config, pp_rank, device) for pp_rank in range(pp)]


def most_loaded_rank(config: Config, device: str = "cuda") -> RankMemory:
    return max(estimate_memory(config, device), key=lambda rank: rank.total)


def estimate_rank_memory(config: Config, pp_rank: int, device: str = "cuda") -> RankMemory:
    state = weights_and_optimizer(config, pp_rank)
    per_mb, peak, p2p = activation_bytes(config, pp_rank, DEVICES[device])
    par = config.parallel
    chunks = par.virtual_pipeline_model_parallel_size or 1
    in_flight = microbatches_in_flight(par.pipeline_model_parallel_size, pp_rank,
                                       config.training.num_microbatches, chunks,
                                       par.pipeline_schedule) / chunks
    weights = {k: v for k, v in state.items() if k in RankMemory.__dataclass_fields__}
    async_save = checkpoint_bytes(config, state) if config.checkpoint.async_save else 0
    return RankMemory(pp_rank=pp_rank, activations=peak, activations_per_microbatch=per_mb,
                      microbatches_in_flight=in_flight, p2p_buffers=p2p,
                      async_save_host=async_save, **weights)
