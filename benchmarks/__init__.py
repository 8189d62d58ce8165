"""The benchmarks of docs/benchmarks.md (each a script: `python benchmarks/<name>.py`, from
any directory) and the GPU checks of gpu_check.sh (benchmarks/gpu/). What several of them
share is a module of benchmarks/common/ (or benchmarks/gpu/runs.py for the GPU checks),
imported as `benchmarks.common.<module>`: a script puts the repository first on the path
when it is run as a file, never its own folder, so no script imports another."""
