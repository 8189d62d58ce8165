"""What the run reports after a step: the log line every --log-interval iterations, the
TensorBoard / W&B scalars, the MoE fields, and the validation and test losses."""

import math
from typing import Callable

import torch.distributed as dist

from megalite.config import Config
from megalite.monitoring.moe_metrics import moe_report
from megalite.monitoring.monitor import Monitor
from megalite.parallel_state import ParallelState, print_rank_last
from megalite.data.shares import configured_shares
from megalite.distributed.fsdp import fsdp_cross_replica_bytes
from megalite.train_step import StepRunner
from megalite.training_log import (IntervalStats, TensorBoardLogger, log_line,
                                   num_floating_point_operations, validation_lines)


class StepReporter:
    """The log line and the scalars of the steps since the last log line."""

    def __init__(self, config: Config, state: ParallelState, runner: StepRunner,
                 tensorboard: TensorBoardLogger, monitor: Monitor, shares):
        self.config, self.state, self.runner = config, state, runner
        self.tensorboard, self.monitor, self.shares = tensorboard, monitor, shares
        self.flops_per_step = num_floating_point_operations(
            config.model, config.training.global_batch_size)
        self.cross_replica_bytes = cross_replica_bytes(config, state, runner)

    def after_step(self, progress, result, lr: float, loss_scale: float,
                   stats: IntervalStats) -> IntervalStats:
        """Report the step `progress` (a TrainState) has just counted; returns the
        statistics to carry on (fresh after a log line)."""
        log, t = self.config.logging, self.config.training
        iteration = progress.iteration
        logging = iteration % log.log_interval == 0
        # Decided alike on every rank (the statistics are collectives), and only where
        # events are written: --log-params-norm must not cost a norm every iteration
        # without TensorBoard.
        scalars = ((log.tensorboard_dir is not None or log.wandb_project is not None)
                   and iteration % log.tensorboard_log_interval == 0)
        extra = self.monitor.statistics() if logging or scalars else {}
        compressor = getattr(self.runner.grad_buffer, "compressor", None)
        if logging and compressor is not None:
            extra["compression_ratio"] = self.runner.grad_buffer.compression_ratio
        # A compressed step's reduction is PowerSGD's over all of DP x CP, not the
        # replicas' all-reduce the field counts (its bytes: the compression ratio).
        compressed = compressor is not None and compressor.steps > compressor.config.start_iter
        if logging and not compressed:
            extra["cross_replica_bytes"] = self.cross_replica_bytes
        if logging and self.config.model.num_experts is not None:
            fields, moe_scalars = moe_report(self.runner.chunks, self.config,
                                             self.state.tp_size, stats.iters,
                                             self.runner.device)
            extra.update(fields)
            self.tensorboard.scalars(iteration, moe_scalars)
        if scalars:
            self.tensorboard.scalars(iteration, {
                "lm loss": result.loss, "learning-rate": lr, "grad-norm": result.grad_norm,
                "loss-scale": loss_scale, "batch-size": t.global_batch_size,
                "num-zeros": extra.get("num_zeros"), "params-norm": extra.get("params_norm"),
                **{f"mtp_{k + 1} loss": v for k, v in enumerate(result.mtp_losses or [])}})
        if not logging:
            return stats
        self._log_line(progress, stats, lr, loss_scale, result.grad_norm, extra)
        if self.shares.uneven:
            print_rank_last(self.shares.describe())
        return IntervalStats()

    def _log_line(self, progress, stats: IntervalStats, lr: float, loss_scale: float,
                  grad_norm, extra: dict):
        config, t = self.config, self.config.training
        seconds_per_iter = stats.elapsed_s / stats.iters
        world_size = dist.get_world_size()
        tflops = self.flops_per_step / (seconds_per_iter * world_size * 1e12)
        tokens_per_s = t.global_batch_size * config.model.seq_length / seconds_per_iter
        report = self.monitor.interval_report(stats.iters, tflops)
        baseline = config.logging.scaling_baseline_tokens_per_sec
        efficiency = None if baseline is None else 100 * tokens_per_s / world_size / baseline
        print_rank_last(log_line(
            iteration=progress.iteration, train_iters=t.train_iters,
            consumed_samples=progress.consumed_train_samples, elapsed_ms=seconds_per_iter * 1e3,
            tflops_per_gpu=tflops if config.logging.log_throughput else None,
            learning_rate=lr, global_batch_size=t.global_batch_size, lm_loss=stats.mean_loss,
            mtp_losses=stats.mtp_losses,
            loss_scale=loss_scale, grad_norm=grad_norm, skipped_iters=stats.skipped_iters,
            nan_iters=stats.nan_iters, tokens_per_second=tokens_per_s,
            mfu_percent=report.mfu_percent, memory_mib=report.memory_mib,
            scaling_efficiency_percent=efficiency, **extra))
        for line in report.lines:
            print_rank_last(line)
        self.tensorboard.scalars(progress.iteration, {"throughput": tflops,
                                             "tokens-per-second": tokens_per_s,
                                             **report.scalars})
        self.monitor.after_log_interval()


def cross_replica_bytes(config: Config, state: ParallelState, runner: StepRunner) -> float | None:
    """Bytes this rank sends across replicas per step (docs/design.md §27), None with one
    replica: the closed form of distributed/hybrid_bytes.py on the buckets or FSDP2 shards
    as built."""
    if state.num_replicas == 1:
        return None
    if runner.grad_buffer is not None:
        return runner.grad_buffer.cross_replica_bytes
    # FSDP2 all-reduces across replicas after each reduce-scatter
    reductions = (config.training.num_microbatches
                  if config.parallel.fsdp_grad_reduce_every_micro_batch else 1)
    return reductions * fsdp_cross_replica_bytes(
        (p for chunk in runner.chunks for p in chunk.parameters()), config.grad_bytes)


def evaluate_and_print(prefix: str, runner: StepRunner, batches, config: Config,
                       tensorboard: TensorBoardLogger, iteration: int | None,
                       progressed: Callable[[], None] = lambda: None):
    """Token-weighted mean loss over --eval-iters global batches drawn from `batches`;
    `progressed()` after each (the watchdog's beat: a long evaluation is progress)."""
    t = config.training
    # The loader reads the configured shares (auto ones move; evaluation keeps these).
    local_shares = configured_shares(t, runner.state.dp_size)[runner.state.dp_rank]
    loss_sum, tokens = 0.0, 0.0
    for _ in range(t.eval_iters):
        s, n = runner.evaluate([next(batches) for _ in range(local_shares)])
        loss_sum, tokens = loss_sum + s, tokens + n
        progressed()
    loss = loss_sum / max(tokens, 1.0)
    for line in validation_lines(prefix, loss):
        print_rank_last(line)
    if iteration is not None:
        tensorboard.scalars(iteration, {"lm loss validation": loss,
                                        "lm loss validation ppl": math.exp(min(20.0, loss))})
