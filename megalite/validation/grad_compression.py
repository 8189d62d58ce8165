"""--grad-compression and the --powersgd-* flags -> GradCompressionConfig, or a ConfigError."""

from megalite.config import GradCompressionConfig, ParallelConfig
from megalite.errors import ConfigError


def grad_compression_config(args, parallel: ParallelConfig) -> GradCompressionConfig:
    config = GradCompressionConfig(
        kind=args.grad_compression, rank=args.powersgd_rank,
        start_iter=args.powersgd_start_iter,
        min_compression_rate=args.powersgd_min_compression_rate,
        error_feedback=args.powersgd_error_feedback, warm_start=args.powersgd_warm_start,
        orthogonalization_epsilon=args.powersgd_orthogonalization_epsilon)
    if not config.enabled:
        return config
    if parallel.use_torch_fsdp2:
        # FSDP2 reduce-scatters inside its own backward hooks, on its sharded gradients:
        # there is no whole gradient matrix on any rank to factorise.
        raise ConfigError("--grad-compression powersgd cannot be used with --use-torch-fsdp2 "
                          "(FSDP2 reduces sharded gradients in its own hooks); use plain DP "
                          "or --use-distributed-optimizer")
    if args.fp16:
        # The loss scale is in every gradient: the error kept from a step scaled by S would
        # be added to one scaled by S' after a change, and an overflow step's inf would stay
        # in the error for good.
        raise ConfigError("--grad-compression powersgd cannot be used with --fp16 (dynamic "
                          "loss scaling would corrupt the error feedback); use --bf16")
    if parallel.grid.dp_cp_size == 1:
        raise ConfigError("--grad-compression powersgd compresses the data-parallel "
                          "reduction, and this layout has none (DP x CP = 1)")
    for name, value, low in (("--powersgd-rank", config.rank, 1),
                             ("--powersgd-start-iter", config.start_iter, 0)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if config.min_compression_rate < 0 or config.orthogonalization_epsilon < 0:
        raise ConfigError("--powersgd-min-compression-rate and "
                          "--powersgd-orthogonalization-epsilon must be >= 0, got "
                          f"{config.min_compression_rate} and "
                          f"{config.orthogonalization_epsilon}")
    return config
