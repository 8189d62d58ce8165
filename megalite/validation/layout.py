"""Parallel layout and batch: TP, CP, PP (and interleaving), DP, ZeRO-1 or FSDP2, the
pipeline schedule, and the global batch split into micro-batches; each check names the flags
and values that do not fit together."""

from dataclasses import dataclass

from megalite.config import DEFAULT_BUCKET_SIZE, ParallelConfig
from megalite.config.flags import flag, from_flags
from megalite.context_parallel import cp_backend_check
from megalite.errors import ConfigError
from megalite.parallel_state import RankGrid, num_microbatches
from megalite.pipeline_parallel.schedules import validate_schedule_args
from megalite.validation.checks import check_positive
from megalite.validation.uneven import is_uneven_split, pipeline_split, shares_batch


@dataclass(frozen=True)
class LayoutFlags:
    GROUP = "parallelism"

    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, help="Layers per model chunk: interleaved 1F1B with --num-layers / (PP x this) "
                   "chunks per pipeline rank.")


def parallel_config(args, world_size: int) -> ParallelConfig:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = _validate_context_parallel(args)
    # EP is carved out of DP x CP: the grid checks that it divides it.
    dp = RankGrid(world_size, tp, pp, cp, args.expert_model_parallel_size,
                  args.num_distributed_optimizer_instances).data_parallel_size
    check_positive(args, "ddp_bucket_size")
    _check_fsdp(args)
    _check_replicas(args)
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        # As in Megatron: only ZeRO-1 gathers parameters, and the overlap of the gather
        # is only worth having together with the overlap of the reduction.
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                          f"--overlap-grad-reduce (got --use-distributed-optimizer="
                          f"{args.use_distributed_optimizer}, --overlap-grad-reduce="
                          f"{args.overlap_grad_reduce})")
    # Megatron forces fp32 gradient accumulation and reduction under --bf16: summing
    # micro-batches and ranks in 8 mantissa bits loses the small updates.
    fp32_grads = args.accumulate_allreduce_grads_in_fp32 or args.bf16
    chunks, layer_counts = pipeline_split(args, pp)
    return from_flags(ParallelConfig, args,
                      virtual_pipeline_model_parallel_size=chunks or _virtual_stages(args, pp),
                      pipeline_layer_counts=layer_counts,
                      data_parallel_size=dp,
                      ddp_bucket_size=args.ddp_bucket_size or DEFAULT_BUCKET_SIZE,
                      accumulate_allreduce_grads_in_fp32=fp32_grads)


def _validate_context_parallel(args) -> int:
    """Each sequence is cut into 2 x CP equal chunks (load balancing), and under sequence
    parallelism each CP rank's s / CP rows are split again over TP."""
    cp, seq, tp = args.context_parallel_size, args.seq_length, args.tensor_model_parallel_size
    check_positive(args, "context_parallel_size")
    if cp == 1:
        return cp
    if seq % (2 * cp):
        raise ConfigError(f"--context-parallel-size={cp} cuts each sequence into 2 x {cp} "
                          f"chunks: --seq-length={seq} is not divisible by {2 * cp}")
    if args.sequence_parallel and (seq // cp) % tp:
        raise ConfigError(f"--sequence-parallel splits each context-parallel rank's "
                          f"--seq-length={seq} / --context-parallel-size={cp} = {seq // cp} "
                          f"rows over --tensor-model-parallel-size={tp}: not divisible")
    backend = "flash" if args.use_flash_attn else args.attention_backend
    cp_backend_check(backend, args.cp_comm_type, args.attention_dropout)
    return cp


def validate_pipeline_schedule(args, parallel: ParallelConfig, num_microbatches: int):
    """--pipeline-schedule: gpipe and zb-h1 run one model chunk per pipeline rank; zb-h1's
    split backward is not traced by torch.compile."""
    schedule = args.pipeline_schedule
    if schedule == "zb-h1" and args.compile_layers:
        # A compiled layer's backward is traced once, whole: its linear layers would compute
        # their weight gradients in B and leave W nothing to do.
        raise ConfigError("--pipeline-schedule zb-h1 splits each linear layer's backward "
                          "into B and W, which a torch.compile'd layer does not; drop "
                          "--compile-layers or use --pipeline-schedule 1f1b")
    validate_schedule_args(parallel.pipeline_model_parallel_size, num_microbatches,
                           parallel.virtual_pipeline_model_parallel_size or 1, schedule)


def _check_fsdp(args):
    """ParallelConfig's FSDP2 and offload fields."""
    fsdp, offload = args.use_torch_fsdp2, args.optimizer_cpu_offload
    if fsdp and args.use_distributed_optimizer:
        raise ConfigError("--use-torch-fsdp2 (ZeRO-2/3) and --use-distributed-optimizer "
                          "(ZeRO-1) both shard the optimizer state: choose one")
    if fsdp and args.overlap_param_gather:
        # FSDP2 always overlaps its all-gathers (prefetching the next unit) and its
        # reduce-scatters (during the backward of earlier layers).
        raise ConfigError("--overlap-param-gather is ZeRO-1's; under --use-torch-fsdp2 FSDP2 "
                          "prefetches the next layer's parameters itself: drop the flag")
    if fsdp and args.pipeline_schedule == "zb-h1":
        # FSDP2 reduce-scatters a layer's gradients when its backward ends, before a
        # deferred W pass has computed the weight gradients.
        raise ConfigError("--pipeline-schedule zb-h1 defers weight gradients past the "
                          "backward, where --use-torch-fsdp2 reduces them: use "
                          "--pipeline-schedule 1f1b or gpipe with FSDP2")
    if fsdp and args.check_weight_hash_across_dp_replicas_interval:
        raise ConfigError("--check-weight-hash-across-dp-replicas-interval compares what DP "
                          "replicas hold alike; under --use-torch-fsdp2 each rank holds its own "
                          "shard of every parameter, so there is nothing to compare")
    if offload and not (fsdp or args.use_distributed_optimizer):
        raise ConfigError("--optimizer-cpu-offload needs --use-torch-fsdp2 or "
                          "--use-distributed-optimizer (got neither)")
    if args.fsdp_grad_reduce_every_micro_batch and not fsdp:
        raise ConfigError("--fsdp-grad-reduce-every-micro-batch needs --use-torch-fsdp2 "
                          "(plain DP and ZeRO-1 reduce once per step, after the last "
                          "micro-batch)")


def _check_replicas(args):
    """--num-distributed-optimizer-instances: hybrid sharding replicates a sharded
    optimizer (the grid checks that N divides DP x CP and expert-DP)."""
    n = args.num_distributed_optimizer_instances
    if n != 1 and not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        # As in Megatron: the replicas are of a sharded optimizer; plain DP has no shards.
        raise ConfigError(f"--num-distributed-optimizer-instances={n} needs "
                          "--use-distributed-optimizer or --use-torch-fsdp2 (got neither)")


def _virtual_stages(args, pp: int) -> int | None:
    """Layers split evenly over p stages, and with --num-layers-per-virtual-pipeline-stage
    k each rank holds v = L / (p k) chunks of k layers (uneven splits: uneven.py)."""
    layers, per_virtual = args.num_layers, args.num_layers_per_virtual_pipeline_stage
    if is_uneven_split(args):
        return None
    if layers % pp:
        raise ConfigError(f"--num-layers={layers} is not divisible by "
                          f"--pipeline-model-parallel-size={pp}")
    if per_virtual is None:
        return None
    if per_virtual <= 0 or layers % (pp * per_virtual):
        raise ConfigError(f"--num-layers={layers} is not divisible by "
                          f"--pipeline-model-parallel-size={pp} x "
                          f"--num-layers-per-virtual-pipeline-stage={per_virtual}")
    return layers // (pp * per_virtual)


def batch(args, parallel: ParallelConfig) -> tuple[int, int, int, tuple[int, ...] | None]:
    """(micro-batch, global batch, micro-batches per DP rank per step (the largest share),
    the micro-batches of each DP rank under --data-parallel-shares, else None). An unset
    global batch is one micro-batch per DP rank, as in Megatron."""
    micro, dp = args.micro_batch_size or 1, parallel.data_parallel_size
    global_batch = args.global_batch_size or micro * dp
    if args.data_parallel_shares is not None:
        shares = shares_batch(args, parallel, micro, global_batch)
        return micro, global_batch, max(shares), shares
    micro_batches = num_microbatches(global_batch, micro, dp)
    validate_schedule_args(parallel.pipeline_model_parallel_size, micro_batches,
                           parallel.virtual_pipeline_model_parallel_size or 1)
    return micro, global_batch, micro_batches, None
