"""--grad-compression and the --powersgd-* flags (GradCompressionConfig): what PowerSGD does
not compose with, and the values it takes."""

from megalite.config import ParallelConfig
from megalite.errors import ConfigError


def check_grad_compression(args, parallel: ParallelConfig):
    if args.grad_compression != "powersgd":
        return
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
    for name, value, low in (("--powersgd-rank", args.powersgd_rank, 1),
                             ("--powersgd-start-iter", args.powersgd_start_iter, 0)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    rate, epsilon = args.powersgd_min_compression_rate, args.powersgd_orthogonalization_epsilon
    if rate < 0 or epsilon < 0:
        raise ConfigError("--powersgd-min-compression-rate and "
                          "--powersgd-orthogonalization-epsilon must be >= 0, got "
                          f"{rate} and {epsilon}")
