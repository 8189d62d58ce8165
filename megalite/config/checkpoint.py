"""CheckpointConfig: where checkpoints go and come from, how often, and how they are written
(megalite/checkpointing/), each field with its flag."""

from dataclasses import dataclass

from megalite.config.flags import flag


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    GROUP = "checkpointing"

    save: str | None = flag(None, help="Directory to write checkpoints to.")
    load: str | None = flag(
        None, help="Directory to resume from (its newest complete checkpoint); point it at "
                   "--save so a restarted job resumes by itself.")
    save_interval: int | None = flag(
        None, help="Save every this many iterations (and always at exit).")
    keep_last: int = flag(
        0, "--keep-last-n-checkpoints",
        help="Delete all but the newest N of this run's checkpoints (0: keep all); the one the "
             "tracker names, and those of another run (--overwrite-save), are never deleted.")
    # checkpointing/save_guard.py
    overwrite_save: bool = flag(
        False, help="megalite's own flag (Megatron-LM writes into --save unchecked): save into a "
                    "--save that holds checkpoints this run does not resume from, which is "
                    "refused otherwise. This run's saves replace that run's checkpoints of the "
                    "same iterations; the others are kept, and the tracker never moves back past "
                    "them, so --load resumes the newest checkpoint in the directory.")
    save_optim: bool = flag(True, "--no-save-optim", help="Do not write optimizer state.")
    load_optim: bool = flag(True, "--no-load-optim", help="Do not read optimizer state.")
    load_rng: bool = flag(True, "--no-load-rng", help="Do not restore the RNG states.")
    finetune: bool = flag(False, help="Load the model only and start at iteration 0.")
    exit_signal_handler: bool = flag(
        False, help="On SIGTERM or SIGUSR1 (any rank) save at the next iteration and exit 0.")
    exit_duration_in_mins: float | None = flag(
        None, help="Save and exit once training has run this long.")
    # memory_estimate/checkpoint.py plans the save; checkpointing/saver.py reports it
    preemption_notice_seconds: float | None = flag(
        None, help="megalite's own flag (Megatron-LM has none): the warning a preemption gives "
                   "before the node goes (spot: 120 s on AWS, 30 s on GCP and Azure). Each "
                   "save's log line reports its seconds against it, and training warns at "
                   "start when the planned save (the largest rank's checkpoint bytes at "
                   "0.32 GB/s per rank, a measured floor: tools/estimate_cost.py plans it at "
                   "yours) takes longer. Pair it with --exit-signal-handler, which saves on "
                   "the notice's SIGTERM.")
    check_for_nan: bool = flag(
        True, "--no-check-for-nan-in-loss-and-grad",
        help="Do not stop when the loss or a gradient is NaN or infinite.")
    # checkpointing/async_save.py
    async_save: bool = flag(
        False, group="async_save", help="Training waits only while each rank copies its state to "
                                        "host memory; a background thread writes the same files a "
                                        "synchronous save writes, and the tracker names the "
                                        "checkpoint once every rank has written its files "
                                        "(checked each iteration). A save while one is pending "
                                        "first waits for it; exits wait for it too.")
    non_persistent_save_interval: int | None = flag(
        None, group="async_save",
        help="Also save every this many iterations to a fast, non-persistent place "
             "(--non-persistent-ckpt-type), kept only until the next --save checkpoint; a "
             "restart prefers it when it is newer and every rank has it.")
    non_persistent_ckpt_type: str | None = flag(
        None, group="async_save", choices=["local"],
        help="local: each rank writes its own state into --non-persistent-local-ckpt-dir, a "
             "directory on its node's disk (Megatron's 'global' and 'in_memory' are not "
             "supported).")
    # checkpointing/local.py
    non_persistent_local_ckpt_dir: str | None = flag(
        None, group="async_save",
        help="The node-local directory of --non-persistent-ckpt-type local.")
