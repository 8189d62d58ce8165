"""Pipeline parallelism (DESIGN.md §5): schedules as action lists, a simulator for them."""

from megalite.pipeline_parallel.schedules import (
    Action, build_schedule, forward_only, interleaved_one_f_one_b, no_pipelining,
    one_f_one_b, validate_schedule_args, warmup_microbatches)

__all__ = [
    "Action", "build_schedule", "forward_only", "interleaved_one_f_one_b", "no_pipelining",
    "one_f_one_b", "validate_schedule_args", "warmup_microbatches",
]
