"""Uneven work (docs/design.md §15): the pipeline's layer split per stage from Megatron's
flags, and the micro-batches of each data-parallel rank (--data-parallel-shares), checked
by name."""

from dataclasses import dataclass

from megalite.config import ParallelConfig
from megalite.config.flags import flag
from megalite.data.shares import parse_weights, share_unit, split_microbatches
from megalite.errors import ConfigError
from megalite.parallel_state import num_microbatches
from megalite.pipeline_parallel.schedules import validate_schedule_args
from megalite.pipeline_parallel.stages import stage_layer_counts


@dataclass(frozen=True)
class UnevenFlags:
    """The flags ParallelConfig.pipeline_layer_counts and TrainingConfig.data_parallel_shares
    are derived from (docs/guide.md "Mixed or straggling hardware")."""
    GROUP = "uneven"

    decoder_first_pipeline_num_layers: int | None = flag(
        None, help="Layers of the first pipeline rank (split evenly over its virtual stages); "
                   "the other ranks share the rest evenly (Megatron's).")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, help="Layers of the last pipeline rank, as above (Megatron's).")
    account_for_embedding_in_pipeline_split: bool = flag(
        False, help="Count the embedding as one layer of the first stage in the even split "
                    "(Megatron's).")
    account_for_loss_in_pipeline_split: bool = flag(
        False, help="Count the output layer and loss as one layer of the last stage in the even "
                    "split (Megatron's).")
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        None, help="Model chunks per pipeline rank v (interleaved 1F1B); the way to interleave "
                   "an uneven split (Megatron's).")
    pipeline_model_parallel_layout: str | None = flag(
        None, help="Megatron's per-stage layout string: not implemented in megalite (refused); "
                   "use the flags above.")
    data_parallel_shares: str | None = flag(
        None, metavar="W0,W1,...|auto",
        help="megalite's own: micro-batches of every global batch per DP rank in proportion to "
             "these weights (one per DP rank, e.g. 3,1), or 'auto': from each DP replica's "
             "measured speed (the --log-straggler timers), re-balanced when a speed moves by "
             "more than --data-parallel-shares-threshold. The samples of a global batch and the "
             "update stay one process's at any shares.")


def is_uneven_split(args) -> bool:
    return (args.decoder_first_pipeline_num_layers is not None
            or args.decoder_last_pipeline_num_layers is not None
            or args.account_for_embedding_in_pipeline_split
            or args.account_for_loss_in_pipeline_split)


def pipeline_split(args, pp: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(model chunks per rank v or None, layers per global stage or None when even) of an
    uneven split or of --num-virtual-stages-per-pipeline-rank; None, None otherwise (the
    even split of --num-layers-per-virtual-pipeline-stage, layout._virtual_stages)."""
    if args.pipeline_model_parallel_layout is not None:
        raise ConfigError("--pipeline-model-parallel-layout is not implemented in megalite; "
                          "use --decoder-first-pipeline-num-layers, "
                          "--decoder-last-pipeline-num-layers or "
                          "--account-for-embedding/loss-in-pipeline-split")
    v = args.num_virtual_stages_per_pipeline_rank
    if v is not None and args.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError("--num-virtual-stages-per-pipeline-rank and "
                          "--num-layers-per-virtual-pipeline-stage both set the model chunks "
                          "per rank: give one")
    if v is not None and v < 1:
        raise ConfigError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {v}")
    if not is_uneven_split(args):
        if v is not None and args.num_layers % (pp * v):
            raise ConfigError(f"--num-layers={args.num_layers} is not divisible by "
                              f"--pipeline-model-parallel-size={pp} x "
                              f"--num-virtual-stages-per-pipeline-rank={v}")
        return v, None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        # Megatron's rule: the layers per chunk differ between stages, so the chunk count
        # is given directly.
        raise ConfigError("with an uneven pipeline split use "
                          "--num-virtual-stages-per-pipeline-rank to interleave, not "
                          "--num-layers-per-virtual-pipeline-stage")
    return v, stage_layer_counts(args.num_layers, pp, v or 1,
                                 args.decoder_first_pipeline_num_layers,
                                 args.decoder_last_pipeline_num_layers,
                                 args.account_for_embedding_in_pipeline_split,
                                 args.account_for_loss_in_pipeline_split)


def shares_batch(args, parallel: ParallelConfig, micro: int,
                 global_batch: int) -> tuple[int, ...]:
    """The micro-batches of each DP rank under --data-parallel-shares: the global batch need
    only divide into micro-batches, and each rank's count must suit the pipeline schedule
    (interleaved 1F1B: multiples of p)."""
    dp, pp = parallel.data_parallel_size, parallel.pipeline_model_parallel_size
    text = args.data_parallel_shares
    if dp < 2:
        raise ConfigError(f"--data-parallel-shares={text} needs data-parallel size >= 2, "
                          f"got {dp}")
    if args.data_parallel_shares_threshold <= 0 or args.data_parallel_shares_window < 1:
        raise ConfigError(f"--data-parallel-shares-threshold must be > 0 and "
                          f"--data-parallel-shares-window >= 1, got "
                          f"{args.data_parallel_shares_threshold} and "
                          f"{args.data_parallel_shares_window}")
    if parallel.use_torch_fsdp2:
        # FSDP2 all-gathers each unit's parameters in every micro-batch's forward (and,
        # resharded, backward): DP collectives that ranks with different micro-batch
        # counts would not pair up.
        raise ConfigError(f"--data-parallel-shares={text} cannot be combined with "
                          f"--use-torch-fsdp2 (its parameter all-gathers run per "
                          f"micro-batch); use --use-distributed-optimizer (ZeRO-1)")
    v = parallel.virtual_pipeline_model_parallel_size or 1
    weights = parse_weights(text, dp) or [1.0] * dp
    shares = split_microbatches(weights, num_microbatches(global_batch, micro),
                                share_unit(parallel))
    for m in set(shares):
        validate_schedule_args(pp, m, v)
    return shares
