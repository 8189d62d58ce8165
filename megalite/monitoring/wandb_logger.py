"""Weights & Biases next to TensorBoard (--wandb-project, --wandb-exp-name, --wandb-save-dir).

As in Megatron-LM, the last rank (the one that holds the loss) opens the run, with the run's
effective config (every field of the frozen `Config`, derived values included) as the W&B
config, and logs each scalar TensorBoard gets, under the same tag, at the same iteration.
WANDB_MODE=offline writes the run under the save directory only (`wandb sync` uploads it).
"""

import dataclasses
import json
import math
import os

from megalite.config import Config


def with_wandb(tensorboard, config: Config, is_last: bool):
    """`tensorboard` itself, or a logger writing to it and to W&B when --wandb-project is
    set on this (the last) rank."""
    if not (is_last and config.logging.wandb_project):
        return tensorboard
    return WandbLogger(tensorboard, config)


def save_dir(config: Config) -> str | None:
    """--wandb-save-dir, else Megatron's {--save}/wandb, else None (wandb's own default)."""
    if config.logging.wandb_save_dir:
        return config.logging.wandb_save_dir
    return os.path.join(config.checkpoint.save, "wandb") if config.checkpoint.save else None


class WandbLogger:
    """Logs to `tensorboard` (a TensorBoardLogger) and to one W&B run."""

    def __init__(self, tensorboard, config: Config):
        import wandb  # validate_args checked that it is installed

        self.tensorboard = tensorboard
        directory = save_dir(config)
        if directory:
            os.makedirs(directory, exist_ok=True)
        log = config.logging
        # The Config as plain JSON values (dtypes and the like as their str).
        effective = json.loads(json.dumps(dataclasses.asdict(config), default=str))
        self.run = wandb.init(project=log.wandb_project, name=log.wandb_exp_name,
                              dir=directory, config=effective)

    def scalars(self, iteration: int, values: dict):
        self.tensorboard.scalars(iteration, values)
        finite = {tag: value for tag, value in values.items()
                  if value is not None and math.isfinite(value)}  # what TensorBoard keeps
        if finite:
            self.run.log(finite, step=iteration)

    def close(self):
        self.tensorboard.close()
        self.run.finish()
