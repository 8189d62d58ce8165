"""Pipeline parallelism (docs/design.md §5): schedules as action lists, a simulator for them."""
