"""The run's length, the optimizer and the learning-rate schedule. Megatron counts the schedule
in samples: the flags that give it in iterations or in samples (ScheduleFlags, kept in no
config) become SchedulerConfig's sample counts here, from the one global batch."""

from dataclasses import dataclass

from megalite.config.flags import flag, flag_name
from megalite.errors import ConfigError
from megalite.validation.checks import check_fraction, check_positive


@dataclass(frozen=True)
class ScheduleFlags:
    GROUP = "lr"

    lr_warmup_iters: int = flag(0, help="Warm-up in iterations (with --train-iters).")
    lr_warmup_samples: int = flag(0, help="Warm-up in samples (with --train-samples).")
    lr_warmup_fraction: float | None = flag(
        None, help="Warm-up as a fraction of the decay steps.")
    lr_decay_iters: int | None = flag(None, help="Default --train-iters.")
    lr_decay_samples: int | None = flag(None, help="Default --train-samples.")
    lr_wsd_decay_iters: int | None = flag(
        None, help="WSD: iterations of the final anneal (with --train-iters).")
    lr_wsd_decay_samples: int | None = flag(
        None, help="WSD: samples of the final anneal (with --train-samples).")


def run_length(args, global_batch: int) -> tuple[int, int]:
    """(train_iters, train_samples): Megatron's --train-samples run counts
    --train-samples // global batch iterations, and its schedule the samples as given."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise ConfigError("pass exactly one of --train-iters and --train-samples "
                          f"(got {args.train_iters} and {args.train_samples})")
    check_positive(args, "train_iters", "train_samples", "exit_interval")
    if args.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.train_iters is not None:
        return args.train_iters, args.train_iters * global_batch
    if args.train_samples < global_batch:
        raise ConfigError(f"--train-samples={args.train_samples} is less than one global "
                          f"batch (--global-batch-size={global_batch})")
    return args.train_samples // global_batch, args.train_samples


def check_optimizer(args):
    check_positive(args, "lr")
    if not 0.0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr={args.min_lr} must be in [0, --lr={args.lr}]")
    check_fraction(args, "adam_beta1", "adam_beta2")
    if args.clip_grad < 0 or args.weight_decay < 0 or args.adam_eps <= 0:
        raise ConfigError(f"need --clip-grad >= 0, --weight-decay >= 0, --adam-eps > 0; got "
                          f"{args.clip_grad}, {args.weight_decay}, {args.adam_eps}")


def scheduler_fields(args, global_batch: int, train_samples: int) -> dict:
    """SchedulerConfig's sample counts: iteration flags are multiplied by the global batch,
    so --train-iters and --train-samples runs share one code path."""
    unit, scale = ("iters", global_batch) if args.train_iters is not None else ("samples", 1)
    _reject_flags(args, unit)

    def samples(name: str) -> int | None:  # --lr-<name>-<unit>, in samples
        value = getattr(args, f"lr_{name}_{unit}")
        return None if value is None else value * scale
    decay, warmup, wsd = samples("decay") or train_samples, samples("warmup"), samples("wsd_decay")
    if args.lr_warmup_fraction is not None:
        if warmup:
            raise ConfigError("pass only one of --lr-warmup-fraction and "
                              "--lr-warmup-iters/--lr-warmup-samples")
        check_fraction(args, "lr_warmup_fraction")
        warmup = int(args.lr_warmup_fraction * decay)
    if decay <= 0 or warmup < 0 or (warmup >= decay and args.lr_decay_style != "constant"):
        raise ConfigError(f"learning-rate warm-up ({warmup} samples) must be shorter than the "
                          f"decay ({decay} samples): check --lr-warmup-* and --lr-decay-*")
    if args.lr_decay_style == "WSD" and (wsd is None or not 0 < wsd <= decay - warmup):
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) in "
                          f"(0, decay - warm-up = {decay - warmup} samples], got {wsd}")
    return dict(max_lr=args.lr, warmup_steps=warmup, decay_steps=decay, wsd_decay_steps=wsd)


def _reject_flags(args, unit: str):
    """The schedule is given in the run's unit: iterations with --train-iters, samples
    with --train-samples; `unit` is the run's, the other's flags are refused."""
    other = "iters" if unit == "samples" else "samples"
    named = [n for n in (f"lr_decay_{other}", f"lr_wsd_decay_{other}")
             if getattr(args, n) is not None]
    for name in named + ([f"lr_warmup_{other}"] if getattr(args, f"lr_warmup_{other}") else []):
        raise ConfigError(f"{flag_name(name)} goes with --train-{other}, not --train-{unit}")
