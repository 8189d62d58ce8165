"""The run's length and batch (TrainingConfig), the optimizer, the learning-rate schedule, the
precision and the data, each field with its flag. Everything counted in samples is derived
from the one global batch (megalite/validation/)."""

from dataclasses import dataclass

import torch

from megalite.config.flags import flag


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    GROUP = "training"

    micro_batch_size: int = flag(help="Sequences per forward/backward pass on one rank.")
    global_batch_size: int = flag(
        help="Samples per optimizer step (default micro batch x DP); the schedule "
             "(--lr-*-iters) is counted in samples of this batch.")
    num_microbatches: int
    """Micro-batches per DP rank per step: global / (micro x DP) (derived); with uneven
    shares the largest share (what the planner sizes a rank for)."""
    data_parallel_shares: tuple[int, ...] | None = None
    """Micro-batches of each DP rank per step, None for num_microbatches each (derived from
    --data-parallel-shares; `auto` starts even and re-balances, data/shares.py)."""
    data_parallel_shares_auto: bool = False
    """--data-parallel-shares auto: shares set from each DP replica's measured speed."""
    data_parallel_shares_threshold: float = flag(
        0.2, group="uneven",
        help="megalite's own: with --data-parallel-shares auto, re-balance when a replica's "
             "speed moves by more than this fraction.")
    data_parallel_shares_window: int = flag(
        3, group="uneven",
        help="megalite's own: with --data-parallel-shares auto, steps timed per measurement of "
             "the speeds (after the first step).")
    # None in the model-only configuration of the tools.
    train_iters: int | None = flag(
        None, help="Optimizer steps of the run (or --train-samples).")
    train_samples: int | None = flag(
        None, help="Sequences of the run, --train-samples // global batch steps (or "
                   "--train-iters).")
    exit_interval: int | None = flag(
        None, help="Exit after the iteration that is a multiple of this.")
    eval_interval: int = flag(1000, help="Iterations between validation runs.")
    eval_iters: int = flag(100, help="Global batches per validation run.")
    seed: int = flag(1234, help="Seed of weights, data order and dropout.")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    GROUP = "training"

    lr: float = flag(group="lr", help="Peak learning rate.")
    weight_decay: float = flag(0.01, help="AdamW decoupled weight decay.")
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_eps: float = flag(1e-8)
    clip_grad: float = flag(1.0, help="Global grad-norm clip (0: off).")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule in units of consumed samples, as Megatron counts it (the flags
    in iterations or samples: validation/schedule.py)."""
    GROUP = "lr"

    max_lr: float
    """Peak learning rate (--lr)."""
    min_lr: float = flag(0.0, help="Learning rate at the end of the decay.")
    decay_style: str = flag("linear", "--lr-decay-style",
                            choices=["constant", "linear", "cosine", "WSD"])
    warmup_steps: int
    """Warm-up length in samples (--lr-warmup-iters x global batch, --lr-warmup-samples
    or --lr-warmup-fraction x decay)."""
    decay_steps: int
    """Samples at which the decay ends (--lr-decay-iters x global batch or
    --lr-decay-samples; default the whole run)."""
    init_lr: float = flag(0.0, "--lr-warmup-init",
                          help="Learning rate at the start of warm-up.")
    wsd_decay_steps: int | None = None
    """WSD: samples of the final anneal (--lr-wsd-decay-iters x global batch or
    --lr-wsd-decay-samples)."""
    wsd_decay_style: str = flag("exponential", "--lr-wsd-decay-style",
                                choices=["exponential", "linear", "cosine", "minus_sqrt"],
                                help="WSD: shape of the final anneal.")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    GROUP = "precision"

    bf16: bool = flag(
        False, help="bf16 parameters, fp32 main parameters; gradients accumulated and reduced in "
                    "fp32 (--accumulate-allreduce-grads-in-fp32 implied).")
    fp16: bool = flag(False, help="fp16 parameters with loss scaling, fp32 main parameters.")
    loss_scale: float | None = flag(None, help="Static fp16 loss scale (default: dynamic).")
    initial_loss_scale: float = flag(2.0 ** 32, help="Dynamic scaling: first scale.")
    min_loss_scale: float = flag(1.0, help="Dynamic scaling: floor.")
    loss_scale_window: int = flag(
        1000, type=float, help="Dynamic scaling: clean steps before the scale doubles.")
    hysteresis: int = flag(2, help="Dynamic scaling: overflows tolerated before the scale "
                                   "halves.")

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters, activations and pipeline sends (Megatron's
        params_dtype), and so the one its matmuls run in; the optimizer's main copies are
        fp32 whatever it is."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def params_bytes(self) -> int:
        """Bytes per element of params_dtype."""
        return self.params_dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    GROUP = "data"

    mock_data: bool = flag(
        False, help="Synthetic counting documents (Megatron's mock GPT dataset).")
    data_path: tuple[str, ...] = flag(
        (), unset=None, nargs="*",
        help="Indexed dataset prefixes, optionally weighted: [w1] p1 [w2 p2 ...].")
    split: str = flag("969,30,1",
                      help="Train/valid/test proportions of each dataset's documents.")
    object_storage_cache_path: str | None = flag(
        None, help="Where --data-path s3://bucket/prefix datasets are cached, once per node "
                   "(megalite caches the .bin with the .idx). megalite's own: --save and --load "
                   "also take s3://bucket/prefix (pip install megalite[s3]; boto3's credentials "
                   "and AWS_ENDPOINT_URL), staged here before upload and downloaded here to "
                   "load (default: megalite-objects in the temporary directory).")
    data_cache_path: str | None = flag(
        None, help="Where sample indices are cached (default: beside the data).")
    eod_mask_loss: bool = flag(
        False, help="No loss on positions whose input token is end-of-document.")
    num_workers: int = flag(2, help="Data loader worker processes.")
