"""Pipeline parallelism (docs/design.md §5): schedules as action lists, a simulator for them."""

from megalite.pipeline_parallel.schedules import (
    SCHEDULES, Action, build_schedule, forward_only, gpipe, interleaved_one_f_one_b,
    no_pipelining, one_f_one_b, validate_schedule_args, warmup_microbatches, zb_h1)
