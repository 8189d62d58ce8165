"""Context parallelism: causal attention across the CP group (docs/design.md §10), by
all-gathering K/V or by ring attention (`--cp-comm-type`; attention.py)."""

from megalite.context_parallel.attention import (
    COMM_TYPES, CommBytes, context_parallel_attention, cp_backend_check, cp_comm_bytes)
