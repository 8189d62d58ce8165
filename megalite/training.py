"""pretrain(): build everything from the flags, run the training loop, evaluate, log.

The mechanics of one step (pipeline schedule, gradient finalisation, optimizer) live in
megalite/train_step.py; this file owns the run: model chunks, data, schedule of
evaluations, exit conditions, the log line and TensorBoard.
"""

import dataclasses
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from megalite.arguments import build_parser, parse_args
from megalite.attention_backends import resolve_backend
from megalite.config import Config, OptimizerKind
from megalite.data.datasets import build_datasets
from megalite.data.shares import share_balancer
from megalite.data.loader import microbatches
from megalite.data.tokenizer import build_tokenizer
from megalite.distributed.fsdp import copy_into, fully_shard_model
from megalite.distributed.grad_buffer import GradBuffer
from megalite.distributed.powersgd import PowerSGD, single_process_names
from megalite.errors import MegaliteError, NumericalError
from megalite.exit_conditions import ExitConditions
from megalite.expert_parallel.grouped_gemm import check_grouped_gemm_device
from megalite.checkpointing import load_checkpoint
from megalite.checkpointing.local import load_newest
from megalite.checkpointing.save_guard import (RunRecord, check_save_directory,
                                               resumes_from_save)
from megalite.checkpointing.saver import CheckpointSaver
from megalite.checkpointing.state import CheckpointState, TrainState
from megalite.host_memory import keep_freed_host_memory
from megalite.initialize import initialize_distributed, set_seed, world_size_from_env
from megalite.megatron_checkpoint.load import load_megatron_checkpoint
from megalite.memory_estimate.checkpoint import MEASURED_WRITE_GBPS, planned_save_seconds
from megalite.megatron_checkpoint.reader import is_megatron_checkpoint
from megalite.model.gpt import build_model_chunks
from megalite.model.init import initialize_buffers, initialize_parameters
from megalite.monitoring.monitor import Monitor
from megalite.monitoring.profiling import start_memory_history
from megalite.object_storage.paths import is_object_url
from megalite.timers import COMPUTE, NO_TIMERS, Timers, synchronize
from megalite.monitoring.wandb_logger import with_wandb
from megalite.optimizer.fsdp_optimizer import FullyShardedOptimizer
from megalite.optimizer.grad_scaler import build_grad_scaler
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, print_rank_0, print_rank_last
from megalite.run_file import dump_run_file, write_run_file
from megalite.tensor_parallel.fp8 import check_fp8_device
from megalite.tensor_parallel.random import build_rng_tracker
from megalite.step_report import StepReporter, evaluate_and_print
from megalite.train_step import StepRunner
from megalite.training_log import IntervalStats, TensorBoardLogger
from megalite.validation import validate_args


def pretrain(argv=None) -> int:
    """Entry point of pretrain_gpt.py. Returns the process exit code."""
    return run_pretrain(argv).exit_code


@dataclasses.dataclass
class Outcome:
    exit_code: int
    signalled: bool = False
    """A signal stopped training before its last iteration (--exit-signal-handler): the run
    saved and exited 0, and a launcher that restarts lost workers restarts it too
    (megalite/ray_launch.py)."""


def run_pretrain(argv=None) -> Outcome:
    """pretrain(), and whether a signal stopped it."""
    keep_freed_host_memory()  # before the run allocates (host_memory.py)
    try:
        args = parse_args(argv)
        tokenizer = None
        if args.tokenizer_type is not None:
            tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                        vocab_file=args.vocab_file, merge_file=args.merge_file,
                                        vocab_size=args.vocab_size)
        config = validate_args(args, world_size_from_env(),
                               tokenizer.vocab_size if tokenizer else None)
        check_save_directory(config.checkpoint)
        rank, _, device = initialize_distributed(config.distributed)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return Outcome(2)
    try:
        state = ParallelState(config.parallel.grid, rank)
        exits = ExitConditions(config.checkpoint, device)
        run_training(config, state, device, tokenizer.eod if tokenizer else None,
                     dump_run_file(args, build_parser()), exits)
        return Outcome(0, exits.signalled)
    except MegaliteError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return Outcome(1)
    finally:
        dist.destroy_process_group()


def build_model(config: Config, state: ParallelState, device: torch.device,
                rng_tracker) -> nn.ModuleList:
    """This rank's model chunks (one per virtual pipeline stage), each its TP shard, on
    `device`, with the attention kernel resolved."""
    dtype = config.precision.params_dtype
    compile_layers = config.layers_compiled(device.type)
    if compile_layers and config.model.compile_layers is None:
        print_rank_0("> compiling each transformer layer with torch.compile (the default "
                     "on a GPU; --no-compile-layers runs eagerly)")
    # gpu_check: fp8_paths
    if config.model.fp8_format and device.type == "cuda":
        check_fp8_device(device)  # at the start: a compiled layer's traced GEMMs do not
    if config.model.moe_grouped_gemm and (note := check_grouped_gemm_device(device, dtype)):
        print_rank_0(note)
    model_config = dataclasses.replace(config.model, attention_backend=resolve_backend(
        config.model.attention_backend, device, dtype), compile_layers=compile_layers)
    seed = config.training.seed
    # Megatron's --bf16/--fp16: the model's parameters (and so its activations) in half
    # precision, built on `device` in that dtype (initial values drawn there in fp32 and
    # rounded); the optimizer keeps fp32 main copies. FSDP2 builds on `meta`, shards
    # (fully_shard_model), then gives each rank's shards the same values (_initialize_sharded).
    fsdp = config.parallel.use_torch_fsdp2
    chunks = build_model_chunks(
        model_config, seed, state.pp_rank, state.pp_size,
        config.parallel.virtual_pipeline_model_parallel_size or 1, state.tp_group,
        rng_tracker, device="meta" if fsdp else device, dtype=torch.float32 if fsdp else dtype,
        cp_group=state.cp_group, layer_counts=config.parallel.pipeline_layer_counts,
        ep_group=state.ep_group)
    if fsdp:
        fully_shard_model(chunks, config, state, device)
        _initialize_sharded(chunks, seed, dtype, state, device)
    return chunks


@torch.no_grad()
def _initialize_sharded(chunks: nn.ModuleList, seed: int, dtype: torch.dtype,
                        state: ParallelState, device: torch.device):
    """The values of sharded chunks: each parameter drawn whole on `device`, as a model
    built there draws it, rounded to `dtype` as a model built in it is (widened back to
    fp32, the main copy a ZeRO-1 run starts from, value for value); this rank keeps its
    rows of its TP block."""
    for chunk in chunks:
        initialize_parameters(chunk, chunk.config, seed, state.tp_rank, state.tp_size, device,
                              lambda param, block: copy_into(param, block.to(dtype).float()),
                              ep_rank=state.ep_rank)
        initialize_buffers(chunk, device)


def build_optimizer(model: nn.Module, config: Config, state: ParallelState,
                    timers: Timers = NO_TIMERS) -> tuple[Optimizer, GradBuffer | None]:
    """The gradient buffer (reduced over DP x CP: all-reduce, or reduce-scatter for ZeRO-1,
    whose shards are laid over DP x CP as Megatron's are, or over a shard group of it under
    hybrid sharding, then all-reduced across replicas; expert parameters over expert-DP;
    none under FSDP2, which reduces its own gradients) and the optimizer reading it: ZeRO-1
    with --use-distributed-optimizer; fp32 main parameters (unsharded) for bf16/fp16 model
    parameters; plain AdamW otherwise."""
    scaler = build_grad_scaler(config.precision)
    p = config.parallel
    if config.optimizer_kind is OptimizerKind.FULLY_SHARDED:  # FSDP2 reduces the gradients
        return FullyShardedOptimizer(model, config.optimizer, scaler, state.tp_group,
                                     state.mp_group, timers), None
    params = [q for q in model.parameters() if q.requires_grad]
    # Over the shard groups: DP x CP and expert-DP themselves with one replica.
    grad_buffer = GradBuffer(params, state.shard_group, p.ddp_bucket_size,
                             shard=config.optimizer_kind.sharded, overlap=p.overlap_grad_reduce,
                             grad_dtype=config.grad_dtype, expert_group=state.expert_shard_group,
                             replica_group=state.replica_group,
                             expert_replica_group=state.expert_replica_group)
    if config.grad_compression.enabled:
        grad_buffer.compressor = PowerSGD(grad_buffer.buckets, single_process_names(model),
                                          config.grad_compression, state.dp_cp_group,
                                          state.tp_group, config.training.seed, timers)
    if config.optimizer_kind.has_main_params:
        optimizer = MixedPrecisionOptimizer(model, config.optimizer, scaler, state.tp_group,
                                            state.mp_group, grad_buffer, p.overlap_param_gather,
                                            cpu_offload=p.optimizer_cpu_offload, timers=timers,
                                            expert_group=state.ep_group)
    else:
        optimizer = Optimizer(model, config.optimizer, scaler, state.tp_group, state.mp_group,
                              timers, expert_group=state.ep_group)
    return optimizer, grad_buffer


def load_any_format(ckpt: CheckpointState) -> dict | None:
    """--load: a megalite checkpoint (checkpointing/), or Megatron-LM's own directory read
    without conversion (megatron_checkpoint/; PowerSGD then starts afresh); the same return
    either way."""
    load = ckpt.config.checkpoint.load
    if not is_object_url(load) and is_megatron_checkpoint(load):
        return load_megatron_checkpoint(load, ckpt)
    return load_checkpoint(load, ckpt)


def resume(ckpt: CheckpointState, device: torch.device) -> bool:
    """--load's checkpoint, or the newer local one every rank has (checkpointing/local.py),
    into `ckpt`, its progress included. Returns whether there was one."""
    flags = ckpt.config.checkpoint
    if flags.load is None and flags.non_persistent_local_ckpt_dir is None:
        return False
    if flags.non_persistent_local_ckpt_dir is None:
        loaded, source = load_any_format(ckpt), flags.load
    else:
        loaded, source = load_newest(ckpt, device, lambda: load_any_format(ckpt))
        if ckpt.compressor is not None and loaded is not None and source != flags.load:
            # A fresh compressor is a restarted one; say so, as a layout change does.
            print_rank_0(" > restarting PowerSGD from uncompressed steps: a "
                         "non-persistent local checkpoint does not hold its state")
    if loaded is not None:
        ckpt.progress = TrainState(**loaded, run=RunRecord(
            resumed_at=loaded["iteration"] if resumes_from_save(flags) else None))
    print_rank_0(f" > resuming from {source} at iteration {ckpt.progress.iteration}"
                 if loaded else f" > no checkpoint in {source}: starting from scratch")
    return loaded is not None


def run_training(config: Config, state: ParallelState, device: torch.device,
                 eod: int | None, run_file: str | None = None,
                 exits: ExitConditions | None = None) -> TrainState:
    """`run_file`: the run's flags as YAML (run_file.dump_run_file), kept beside the
    TensorBoard events and in each checkpoint so the run can be repeated from either.
    `exits`: the caller's, to read why the run stopped (else its own)."""
    start_memory_history(config.monitoring, device)  # before the model's allocations
    warn_if_save_outlasts_notice(config)
    set_seed(config.training.seed)
    rng_tracker = build_rng_tracker(config.training.seed, state.tp_rank, device,
                                    state.cp_rank, state.tp_size)
    model = build_model(config, state, device, rng_tracker)
    # One set of phase timers for the step, the optimizer and the monitor that reports them
    # (--log-straggler compares the compute phases across ranks).
    # (--data-parallel-shares auto measures each rank's speed with the same timers.)
    timers = Timers(config.monitoring.timing_log_level, device,
                    extra=COMPUTE if config.monitoring.log_straggler
                    or config.training.data_parallel_shares_auto else ())
    optimizer, grad_buffer = build_optimizer(model, config, state, timers)
    monitor = Monitor(config, state, device, model, optimizer, timers)
    runner = StepRunner(model, optimizer, config, state, device, grad_buffer, timers)
    compressor = grad_buffer.compressor if grad_buffer is not None else None
    scheduler = LRScheduler(optimizer, config.scheduler)
    ckpt = CheckpointState(model, optimizer, scheduler, state, config, TrainState(),
                           rng_tracker, compressor, run_file)
    monitor.resumed = resume(ckpt, device)
    progress = ckpt.progress
    saver = (CheckpointSaver(ckpt, device, monitor.watchdog.suspended)
             if config.checkpoint.save else None)
    train_ds, valid_ds, test_ds = build_datasets(config, eod, is_builder=dist.get_rank() == 0,
                                                 barrier=dist.barrier)
    tensorboard = _scalar_logger(config, run_file)
    if state.dp_rank == 0 and state.cp_rank == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({state.tp_rank}, {state.pp_rank}): {sum(p.numel() for p in model.parameters())}",
              flush=True)
    valid = (microbatches(valid_ds, progress.consumed_valid_samples, config, state, device)
             if config.training.eval_iters > 0 and valid_ds is not None else None)
    try:
        stopped = train(config, state, runner, scheduler, train_ds, valid, tensorboard, device,
                        progress, saver, monitor,
                        exits or ExitConditions(config.checkpoint, device))
        if stopped:
            # A signal or the time budget: the checkpoint is written; leave at once, within
            # the grace period a scheduler gives before it kills the job.
            return progress
        _final_evaluation(config, state, device, runner, valid, test_ds, tensorboard,
                          progress.iteration, monitor.watchdog.beat)
    finally:
        monitor.close(progress.iteration)
        tensorboard.close()
    return progress


def _scalar_logger(config: Config, run_file: str | None) -> TensorBoardLogger:
    """TensorBoard (and W&B) on the last rank, which logs; the run file beside its events."""
    is_last = dist.get_rank() == dist.get_world_size() - 1
    tensorboard = with_wandb(TensorBoardLogger(config.logging.tensorboard_dir if is_last
                                               else None), config, is_last)
    if is_last and config.logging.tensorboard_dir and run_file:
        write_run_file(config.logging.tensorboard_dir, run_file)
    return tensorboard


def _final_evaluation(config: Config, state: ParallelState, device: torch.device,
                      runner: StepRunner, valid, test_ds, tensorboard: TensorBoardLogger,
                      iteration: int, progressed) -> None:
    """After the last iteration: the validation loss (its scalars unless the loop just
    wrote them) and the test loss."""
    if valid is not None:
        evaluated = iteration % config.training.eval_interval == 0
        evaluate_and_print(f"iteration {iteration} on validation set", runner, valid, config,
                           tensorboard, None if evaluated else iteration, progressed)
    if config.training.eval_iters > 0 and test_ds is not None:
        evaluate_and_print(f"iteration {iteration} on test set", runner,
                           microbatches(test_ds, 0, config, state, device), config,
                           tensorboard, None, progressed)


def warn_if_save_outlasts_notice(config: Config):
    """At start: the planned save time of this model and layout against
    --preemption-notice-seconds (a save on the notice must end before the node goes)."""
    notice = config.checkpoint.preemption_notice_seconds
    if notice is None:
        return
    seconds, nbytes = planned_save_seconds(config, MEASURED_WRITE_GBPS)
    if seconds > notice:
        print_rank_0(f"WARNING: the planned save takes {seconds:.3g} s, longer than the "
                     f"{notice:g} s --preemption-notice-seconds: the slowest rank writes "
                     f"{nbytes / 1e9:.3g} GB at {MEASURED_WRITE_GBPS:g} GB/s (a measured floor; "
                     "tools/estimate_cost.py --save-gbps plans at your storage's rate). A save "
                     "on the notice would be cut off; checkpoint more often or write faster")


def train(config: Config, state: ParallelState, runner: StepRunner, scheduler, train_ds,
          valid, tensorboard: TensorBoardLogger, device: torch.device, progress: TrainState,
          save: CheckpointSaver | None, monitor: Monitor, exits: ExitConditions) -> bool:
    """Train from `progress` on (updating it); `save` writes checkpoints (None: no --save);
    every exit waits for its pending write. Returns whether a signal or
    --exit-duration-in-mins stopped the run."""
    t = config.training
    saved_at = progress.iteration
    stats = IntervalStats()
    shares = share_balancer(config, state, monitor.timers)
    reporter = StepReporter(config, state, runner, tensorboard, monitor, shares)
    batches = microbatches(train_ds, progress.consumed_train_samples, config, state, device,
                           shares.shares)
    while progress.iteration < t.train_iters:
        monitor.before_step(progress.iteration)
        start = time.perf_counter()
        shares.before_step()
        with monitor.timers("batch-generator"):
            step_batches = [next(batches) for _ in range(shares.local)]
        loss_scale = runner.optimizer.loss_scale
        try:
            result = runner.train_step(step_batches)
        except NumericalError as error:
            raise NumericalError(f"iteration {progress.iteration + 1}: {error}") from None
        except torch.OutOfMemoryError:
            monitor.on_out_of_memory()
            raise
        if not result.skipped:
            scheduler.step(t.global_batch_size)
        # As Megatron logs it: the rate after this iteration's scheduler step, which the
        # next iteration uses.
        lr = scheduler.lr
        synchronize(device)  # or the time measures the kernels' launch, not their work
        elapsed = time.perf_counter() - start
        progress.iteration += 1
        progress.consumed_train_samples += t.global_batch_size
        stats.add(result.loss, result.skipped, elapsed, result.mtp_losses)
        monitor.after_step(progress.iteration)
        if shares.after_step(progress.iteration):  # new shares from the next global batch
            batches = microbatches(train_ds, progress.consumed_train_samples, config, state,
                                   device, shares.shares)
        stats = reporter.after_step(progress, result, lr, loss_scale, stats)
        if valid is not None and progress.iteration % t.eval_interval == 0:
            evaluate_and_print(f"iteration {progress.iteration}", runner, valid, config,
                               tensorboard, progress.iteration, monitor.watchdog.beat)
            progress.consumed_valid_samples += t.eval_iters * t.global_batch_size
        if save:
            saved_at = _save_due(save, config.checkpoint.save_interval, progress.iteration,
                                 saved_at)
        reason = exits.check()
        if reason:
            _final_save(save, saved_at, progress.iteration)
            print_rank_0(f"exiting program after iteration {progress.iteration}: {reason}")
            return True
        if t.exit_interval and progress.iteration % t.exit_interval == 0:
            print_rank_last(f"exiting program at iteration {progress.iteration}")
            break
    _final_save(save, saved_at, progress.iteration)
    return False


def _save_due(save: CheckpointSaver, interval: int | None, iteration: int,
              saved_at: int) -> int:
    """The persistent save --save-interval asks for, else a non-persistent one when due;
    returns the iteration of the last persistent save."""
    save.poll()
    if interval and iteration % interval == 0:
        save.save(iteration)
        return iteration
    save.save_non_persistent(iteration)
    return saved_at


def _final_save(save: CheckpointSaver | None, saved_at: int, iteration: int):
    """At an exit: this iteration saved unless it just was, every pending write waited for."""
    if save and saved_at != iteration:
        save.save(iteration)
    if save:
        save.wait()
