"""--expert-model-parallel-size > 1: what expert parallelism composes with. The grid checks
that EP divides DP x CP (parallel_state.RankGrid), validation/moe.py that it divides
--num-experts; here the combinations not built, refused by name."""

from megalite.config import ParallelConfig
from megalite.errors import ConfigError


def check_expert_parallel(args, parallel: ParallelConfig):
    ep = parallel.expert_model_parallel_size
    if args.data_parallel_shares is not None:
        # The ranks of an EP group are DP ranks exchanging tokens in every micro-batch's
        # forward and backward: they must run the same number of micro-batches.
        raise ConfigError(f"--data-parallel-shares with --expert-model-parallel-size={ep} is "
                          "not built (the EP ranks of a group exchange tokens in every "
                          "micro-batch, so they need equal shares)")
    if args.grad_compression != "none":
        # PowerSGD compresses the DP x CP reduction of every bucket; expert buckets are
        # reduced over expert-DP.
        raise ConfigError(f"--grad-compression {args.grad_compression} with "
                          f"--expert-model-parallel-size={ep} is not built")
