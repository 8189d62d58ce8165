"""Tensor and sequence parallelism (docs/design.md §4): communication operators, sharded layers,
vocab-parallel cross-entropy and the dropout RNG tracker."""

from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    allreduce_sequence_parallel_grads)
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megalite.tensor_parallel.random import (
    MODEL_PARALLEL_RNG, RNGStatesTracker, build_rng_tracker, model_parallel_seed)
