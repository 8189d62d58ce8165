"""The cluster check's phases (docs/design.md §13), behind tools/check_cluster.py's command
line: `checks.run_checks` runs them in order, each returning a `report.Section`.

    correctness.py  every layout against one process (layout_check.py's comparisons)
    collectives.py  bus bandwidth at the sizes the layouts send (layout_tune.step_traffic)
    scaling.py      weak scaling of plain DP
    checkpoint.py   save and load throughput, and the projected save of a large model
    recovery.py     a rank SIGKILLed under torchrun --max-restarts 1, timed to its resumed step
    tuning.py       --tune: the layouts the planner says fit, pruned, timed (layout_trial.py)
    report.py, charts.py  REPORT.md and its PNGs

Each phase takes the tool's parsed flags (`args`), the check's model flags (pretrain_gpt.py's)
and the launch's rank, world size and device; every rank of the launch calls it together.
"""
