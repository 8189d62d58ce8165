"""SMOKE=1: a benchmark at a tiny size, so CI runs every command docs/ shows.

The convention of benchmarks/gpu_check.sh: the command exactly as the docs write it, with
SMOKE=1 in the environment, runs every step of the script (its launches, its closed-form
checks, its tables) at sizes that take seconds on a 2-core CPU. The sizes replace whatever
the command line asked for, so the numbers printed are not measurements; a check that
fails (a measured figure against its closed form) still exits non-zero.
tests/test_doc_commands.py runs them.
"""
import os

ON = os.environ.get("SMOKE", "0") == "1"


def shrink(args, **sizes):
    """In SMOKE mode, set each of `sizes` on the parsed `args` and say so; else nothing."""
    if ON:
        for name, value in sizes.items():
            if not hasattr(args, name):
                raise AttributeError(f"smoke size for an unknown argument: {name}")
            setattr(args, name, value)
        print("SMOKE=1, tiny sizes (not a measurement): "
              + ", ".join(f"{name}={value}" for name, value in sizes.items()), flush=True)
    return args
