"""What a run reports about itself beyond the loss (issue 17): where a step's time goes,
how close it is to the hardware's peak, how much memory each rank holds, which rank is
slow, whether data-parallel replicas still agree, profiler traces, recovery time.

- timers.py: Megatron's named phase timers (--timing-log-level), also the profiler's ranges;
- peak_flops.py: dense peak FLOP/s per device and dtype, for MFU;
- memory.py: this rank's memory (CUDA allocator or resident set);
- statistics.py: params norm, zeros in the gradients;
- replica_check.py: DP replicas hash their parameters and compare;
- profiling.py: torch.profiler traces and CUDA memory snapshots;
- watchdog.py: ends a rank whose training stopped progressing (a hung collective);
- monitor.py: the one object the training loop talks to.
"""
