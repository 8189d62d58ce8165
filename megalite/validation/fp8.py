"""The FP8 flags (--fp8-format, --fp8-recipe, --first-last-layers-bf16): what megalite
builds of Megatron's recipes and what FP8 does not compose with (docs/design.md "FP8")."""

from megalite.config import ParallelConfig
from megalite.errors import ConfigError


def check_fp8(args, parallel: ParallelConfig):
    """Raises ConfigError for an FP8 combination that cannot work."""
    if args.fp8_format is None:
        if args.first_last_layers_bf16:
            raise ConfigError("--first-last-layers-bf16 keeps layers out of FP8 and needs "
                              "--fp8-format")
        return
    if args.fp8_recipe in ("delayed", "mxfp8", "blockwise"):
        raise ConfigError(f"--fp8-recipe {args.fp8_recipe} is Megatron's (Transformer "
                          f"Engine) and not built in megalite: use tensorwise or rowwise")
    if args.fp8_recipe == "rowwise" and args.fp8_format != "e4m3":
        raise ConfigError(f"--fp8-recipe rowwise quantizes gradients to e4m3 as torchao's "
                          f"rowwise recipe does: use --fp8-format e4m3, not "
                          f"{args.fp8_format}")
    if parallel.context_parallel_size > 1:
        # A GEMM's tokens would be split over the CP group, and the scales of activations
        # and gradients with them: not built.
        raise ConfigError(f"--fp8-format with --context-parallel-size "
                          f"{parallel.context_parallel_size} is not supported: FP8 scales "
                          f"are reduced over the TP group only")
    if args.first_last_layers_bf16:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
        if start < 0 or end < 0 or start + end >= args.num_layers:
            raise ConfigError(f"--num-layers-at-start-in-bf16={start} and "
                              f"--num-layers-at-end-in-bf16={end} must be >= 0 and leave "
                              f"at least one of --num-layers={args.num_layers} in FP8")
