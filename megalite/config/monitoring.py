"""What a run reports: the log line, TensorBoard and W&B (LoggingConfig), and what it reports
about itself beyond the loss (MonitoringConfig, megalite/monitoring/), each field with its
flag."""

from dataclasses import dataclass

from megalite.config.flags import flag


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    GROUP = "logging"

    log_interval: int = flag(100, help="Iterations per log line.")
    log_throughput: bool = flag(False, help="Add TFLOP/s/GPU and tokens/s to the log line.")
    tensorboard_dir: str | None = flag(
        None, help="Where TensorBoard event files go (none written without it).")
    tensorboard_log_interval: int = flag(1, help="Iterations between TensorBoard scalars.")
    scaling_baseline_tokens_per_sec: float | None = flag(
        None, metavar="TOKENS_PER_SEC",
        help="Tokens/s of one GPU on this model (megalite's own flag; e.g. from "
             "tools/check_cluster.py): adds the scaling efficiency, tokens/s per GPU over it, "
             "to the log line.")
    # Written by the last rank (monitoring/wandb_logger.py).
    wandb_project: str | None = flag(
        None, group="wandb", help="W&B project; a run is logged when given (WANDB_MODE=offline "
                                  "writes it locally). Needs pip install -e .[wandb].")
    wandb_exp_name: str | None = flag(
        None, group="wandb", help="The W&B run's name (required with a project).")
    wandb_save_dir: str | None = flag(
        None, group="wandb", help="Where W&B writes its files (default {--save}/wandb, as "
                                  "Megatron; without --save, wandb's default).")


@dataclass(frozen=True, kw_only=True)
class MonitoringConfig:
    GROUP = "monitoring"

    peak_tflops: float | None = flag(
        None, help="Dense peak TFLOP/s of one device, for the MFU on the log line (megalite's "
                   "own flag; default: a table of common GPUs, see "
                   "megalite/monitoring/peak_flops.py; no MFU on a CPU without it).")
    log_memory_to_tensorboard: bool = flag(
        False, help="Memory (max over ranks) as TensorBoard scalars.")
    timing_log_level: int = flag(
        0, choices=[0, 1, 2],
        help="0: iteration time only; 1: also the phases run once a step (gradient reduction, "
             "optimizer, ...); 2: also per micro-batch (forward/backward compute, pipeline "
             "send/recv). Levels 1-2 record a timing event on the GPU at each phase boundary "
             "(read between steps; the host does not wait).")
    timing_log_option: str = flag("minmax", choices=["max", "minmax", "all"],
                                  help="Timers over ranks: max, (min, max), or every rank's.")
    log_timers_to_tensorboard: bool = flag(
        False, help="Each timer's max over ranks as a TensorBoard scalar.")
    log_straggler: bool = flag(
        False, help="Name the slowest and fastest rank (and host) by compute time each log "
                    "interval.")
    check_weight_hash_across_dp_replicas_interval: int | None = flag(
        None, help="Every N iterations compare the data-parallel replicas' parameter hashes; "
                   "stop with an error naming the ranks if they differ.")
    log_params_norm: bool = flag(False, help="Parameter L2 norm on the log line.")
    log_num_zeros_in_grad: bool = flag(False, help="Zero gradient elements on the log line.")
    profile: bool = flag(
        False, help="Write a torch.profiler Chrome trace (--profile-dir) of the steps "
                    "--profile-step-start+1 .. --profile-step-end on --profile-ranks.")
    profile_step_start: int = flag(10, help="Iterations done when the profile starts.")
    profile_step_end: int = flag(12, help="Iteration after which it stops.")
    profile_ranks: tuple[int, ...] = flag((0,), nargs="+", help="Global ranks that profile.")
    profile_dir: str = flag(
        "profile", unset=None,
        help="Where traces go (megalite's own flag; default --tensorboard-dir, else "
             "./profile).")
    record_memory_history: bool = flag(
        False, help="GPU: record the CUDA allocator's history and write a snapshot to "
                    "--memory-snapshot-path (at the profile's end, else after the first log "
                    "interval, and when a step runs out of memory).")
    memory_snapshot_path: str = flag(
        "snapshot.pickle", help="Where the CUDA memory snapshot goes (.rank<r> added with "
                                "several ranks).")
