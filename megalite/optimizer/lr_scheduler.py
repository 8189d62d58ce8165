"""Megatron's learning-rate schedule: linear warm-up, then constant, linear, cosine or
WSD (warmup-stable-decay, Hu et al. 2024) decay to --min-lr.

Steps are consumed samples; the scheduler advances by the global batch size per
iteration, so --train-iters and --train-samples runs follow one formula.
"""

import math

from megalite.config import SchedulerConfig


def learning_rate(config: SchedulerConfig, num_steps: int) -> float:
    """The learning rate after `num_steps` samples have been trained on."""
    max_lr, min_lr = config.max_lr, config.min_lr
    if config.warmup_steps > 0 and num_steps <= config.warmup_steps:
        return config.init_lr + (max_lr - config.init_lr) * num_steps / config.warmup_steps
    if config.decay_style == "constant":
        return max_lr
    if num_steps > config.decay_steps:
        return min_lr
    if config.decay_style != "WSD":
        ratio = (num_steps - config.warmup_steps) / (config.decay_steps - config.warmup_steps)
        style = config.decay_style
    else:  # stable at max_lr until the last wsd_decay_steps, then anneal to min_lr
        anneal_start = config.decay_steps - config.wsd_decay_steps
        ratio = max(num_steps - anneal_start, 0) / config.wsd_decay_steps
        style = config.wsd_decay_style
    return min_lr + _decay(style, ratio) * (max_lr - min_lr)


def _decay(style: str, ratio: float) -> float:
    """The coefficient of max_lr - min_lr, from 1 at ratio 0 to 0 at ratio 1."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


class LRScheduler:
    """Sets the optimizer's learning rate from the number of samples consumed."""

    def __init__(self, optimizer, config: SchedulerConfig):
        self.optimizer, self.config = optimizer, config
        self.num_steps = 0
        self._apply()

    @property
    def lr(self) -> float:
        return learning_rate(self.config, self.num_steps)

    def step(self, increment: int):
        self.num_steps += increment
        self._apply()

    def _apply(self):
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict):
        self.num_steps = int(state["num_steps"])
        self._apply()
