"""What the benchmarks share: SMOKE mode (smoke.py), starting ranks (rank_setup.py), a model
built as pretrain() builds it for the checkpoint benchmarks (checkpoint_run.py), and running
the preprocessing tools (preprocess_runs.py)."""
