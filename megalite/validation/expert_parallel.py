"""--expert-model-parallel-size > 1: what expert parallelism composes with. The grid checks
that EP divides DP x CP (parallel_state.RankGrid), validation/moe.py that it divides
--num-experts; here the combinations not built, refused by name."""

from megalite.config import ParallelConfig
from megalite.errors import ConfigError


def check_expert_parallel(args, parallel: ParallelConfig):
    ep = parallel.expert_model_parallel_size
    if parallel.use_torch_fsdp2:
        # fully_shard shards every parameter over DP x CP; experts would need their own
        # mesh (expert-DP), as torchtitan's does.
        raise ConfigError(f"--use-torch-fsdp2 with --expert-model-parallel-size={ep} is not "
                          "built (the experts would need their own FSDP mesh over "
                          "expert-data-parallel); use --use-distributed-optimizer (ZeRO-1)")
    if args.grad_compression != "none":
        # PowerSGD compresses the DP x CP reduction of every bucket; expert buckets are
        # reduced over expert-DP.
        raise ConfigError(f"--grad-compression {args.grad_compression} with "
                          f"--expert-model-parallel-size={ep} is not built")
