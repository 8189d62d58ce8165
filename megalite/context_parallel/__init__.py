"""Context parallelism: attention across the CP group (docs/design.md §10).

Each sequence is cut into 2·CP chunks and CP rank i holds chunks i and 2·CP-1-i
(`context_split.load_balanced_chunks`); `context_parallel_attention` computes causal attention over the whole
sequence for this rank's rows, by all-gathering K/V or by ring attention (`--cp-comm-type`).
"""

from megalite.context_parallel.attention import (
    COMM_TYPES, CommBytes, context_parallel_attention, cp_backend_check, cp_comm_bytes)

__all__ = ["COMM_TYPES", "CommBytes", "context_parallel_attention", "cp_backend_check",
           "cp_comm_bytes"]
