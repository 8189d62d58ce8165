"""The checks of benchmarks/gpu_check.sh; what they share is runs.py."""
