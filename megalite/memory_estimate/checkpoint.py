"""Host memory an --async-save holds (checkpointing/async_save.py, docs/memory.md).

The snapshot copies what the rank's files hold into host buffers kept between saves: on DP
rank 0 (under FSDP2 too, where every DP rank gathers each value and the others drop it) its
TP shard of the parameters in their own dtype, and the fp32 main copy and two moments of
what its optimizer owns (4 + 8 bytes per element; none with --no-save-optim). The RNG
states are a few kilobytes.
"""

from megalite.config import Config


def async_save_host_bytes(config: Config, state: dict) -> int:
    """`state`: weights.weights_and_optimizer's dict of DP rank 0. 0 without --async-save."""
    if not config.checkpoint.async_save:
        return 0
    params = config.precision.params_bytes * state["num_parameters"]
    optimizer = 12 * state["owned"] if config.checkpoint.save_optim else 0
    return params + optimizer
