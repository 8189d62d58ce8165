"""The checks of what surrounds the model: the data source and its tokenizer (whose flags no
config keeps: training.py builds the tokenizer from them), precision, checkpoints,
monitoring and W&B."""

import importlib.util
from dataclasses import dataclass

from megalite.config.flags import flag
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.errors import ConfigError
from megalite.object_storage.paths import check_storage_path
from megalite.validation.checks import check_positive


@dataclass(frozen=True)
class TokenizerFlags:
    GROUP = "data"

    vocab_size: int | None = flag(None, help="Vocabulary size for --mock-data / NullTokenizer.")
    tokenizer_type: str | None = flag(None, choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(
        None, help="SentencePiece model, or tokenizer.json for HuggingFaceTokenizer.")
    vocab_file: str | None = flag(None, help="GPT2BPETokenizer vocab.json.")
    merge_file: str | None = flag(None, help="GPT2BPETokenizer merges.txt.")


def check_data_source(args):
    if args.mock_data == bool(args.data_path):
        raise ConfigError("pass exactly one data source: --data-path PREFIX... (with "
                          "--tokenizer-type) or --mock-data (with --vocab-size)")
    if args.data_path and args.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its files) to know the "
                          "vocabulary and the end-of-document id")
    if args.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {args.num_workers}")
    for value in args.data_path or ():
        check_storage_path("--data-path", value)


def check_wandb(args):
    """On every rank, before any work: the last rank alone opens the W&B run."""
    if not args.wandb_project:
        return
    if not args.wandb_exp_name:
        raise ConfigError(f"--wandb-project {args.wandb_project}: --wandb-exp-name is "
                          "required (the run's name)")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs wandb, which is not installed: "
                          "pip install -e .[wandb]  (or pip install wandb)")


def precision_fields(args) -> dict:
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    check_positive(args, "loss_scale")
    if args.min_loss_scale <= 0 or args.initial_loss_scale < args.min_loss_scale:
        raise ConfigError(f"need 0 < --min-loss-scale={args.min_loss_scale} <= "
                          f"--initial-loss-scale={args.initial_loss_scale}")
    if args.loss_scale_window <= 0 or args.hysteresis <= 0:
        raise ConfigError(f"--loss-scale-window={args.loss_scale_window} and "
                          f"--hysteresis={args.hysteresis} must be positive")
    return dict(loss_scale_window=int(args.loss_scale_window))


def check_checkpoint(args):
    check_positive(args, "save_interval", "exit_duration_in_mins", "preemption_notice_seconds")
    check_storage_path("--save", args.save)
    check_storage_path("--load", args.load)
    # The node's own disk, by definition.
    check_storage_path("--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir,
                       local_only=True)
    if args.save_interval is not None and args.save is None:
        raise ConfigError(f"--save-interval={args.save_interval} needs --save (where to write)")
    if args.keep_last_n_checkpoints < 0:
        raise ConfigError("--keep-last-n-checkpoints must be >= 0 (0 keeps all), got "
                          f"{args.keep_last_n_checkpoints}")
    if args.finetune and args.load is None:
        raise ConfigError("--finetune needs --load (the checkpoint to start from)")
    if args.async_save and args.save is None:
        raise ConfigError("--async-save needs --save (where to write)")
    if args.preemption_notice_seconds is not None and args.save is None:
        raise ConfigError(f"--preemption-notice-seconds={args.preemption_notice_seconds} needs "
                          "--save (where the save on the notice goes)")
    if args.overwrite_save and args.save is None:
        raise ConfigError("--overwrite-save needs --save (the directory to write into)")
    _check_non_persistent(args)


def _check_non_persistent(args) -> None:
    check_positive(args, "non_persistent_save_interval")
    interval = args.non_persistent_save_interval
    if interval is None:
        return
    if args.save is None:
        raise ConfigError(f"--non-persistent-save-interval={interval} needs --save (the "
                          "persistent checkpoints it stands in for between saves)")
    if args.non_persistent_ckpt_type != "local":
        raise ConfigError(f"--non-persistent-save-interval={interval} needs "
                          "--non-persistent-ckpt-type local, got "
                          f"{args.non_persistent_ckpt_type}")
    if args.non_persistent_local_ckpt_dir is None:
        raise ConfigError("--non-persistent-ckpt-type local needs "
                          "--non-persistent-local-ckpt-dir (a directory on each node's disk)")


def monitoring_fields(args, world_size: int) -> dict:
    check_positive(args, "peak_tflops", "check_weight_hash_across_dp_replicas_interval",
                   "scaling_baseline_tokens_per_sec")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ConfigError("--profile needs 0 <= --profile-step-start < --profile-step-end, "
                              f"got {args.profile_step_start} and {args.profile_step_end}")
        outside = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"--profile-ranks {outside} outside the world of {world_size} "
                              "ranks")
    return dict(profile_dir=args.profile_dir or args.tensorboard_dir or "profile")
