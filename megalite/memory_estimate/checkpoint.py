"""What a checkpoint costs a rank: the bytes it writes, the host memory an --async-save
holds (checkpointing/async_save.py, docs/memory.md), and the planned save time.

DP rank 0 of each pipeline rank writes (and, under --async-save, snapshots into host buffers
kept between saves) its TP shard of the parameters in their own dtype, and the fp32 main
copy and two moments of what its optimizer owns (4 + 8 bytes per element; none with
--no-save-optim); under FSDP2 every DP rank gathers each value and the others drop it. The
RNG states are a few kilobytes. Other DP ranks write only their optimizer shards, so DP
rank 0 of the most loaded pipeline rank is the slowest writer: its bytes over the write
bandwidth one rank gets is the planned save time.
"""

from megalite.config import Config
from megalite.memory_estimate.weights import weights_and_optimizer

MEASURED_WRITE_GBPS = 0.32
"""GB/s one rank's save_checkpoint wrote, fsync included, on the quiet 2-core VM of
docs/benchmarks.md ("Checkpoint save and load throughput"): a floor, not a cluster's figure
(tools/check_cluster.py measures the user's)."""


def checkpoint_bytes(config: Config, state: dict) -> int:
    """Bytes DP rank 0 writes; `state`: weights.weights_and_optimizer's dict of that rank."""
    params = config.precision.params_bytes * state["num_parameters"]
    optimizer = 12 * state["owned"] if config.checkpoint.save_optim else 0
    return params + optimizer


def planned_save_seconds(config: Config, write_gbps: float) -> tuple[float, int]:
    """(seconds, bytes) of the slowest rank's save at `write_gbps` GB/s per rank."""
    pp = config.parallel.pipeline_model_parallel_size
    most = max(checkpoint_bytes(config, weights_and_optimizer(config, r)) for r in range(pp))
    return most / (write_gbps * 1e9), most
