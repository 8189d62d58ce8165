"""How long a training run takes and what it costs, on demand and on spot, and how often
to checkpoint on spot (issue 45).

Pass the GPU kind and count, an MFU (or a cluster check's report that measured one), the
run's length in tokens (or pretrain_gpt.py's --train-iters / --train-samples with its
global batch), and pretrain_gpt.py's model and layout flags:

    python tools/estimate_cost.py --gpu A100 --num-gpus 8 --mfu 0.45 \\
        --train-tokens 2e10 --yaml-cfg examples/configs/llama_7b.yaml --vocab-size 32000 \\
        --preemption-rate 0.05

FLOPs per token are the MFU's count (megalite/training_log.py), the peak is
megalite/monitoring/peak_flops.py's dense peak for the run's dtype, prices come from
megalite/cost/prices.yaml (published, each with its source and date) unless given. On spot
(--preemption-rate), the save time of this model and layout (planned from its largest
rank's checkpoint bytes, or --save-seconds) and the mean time between preemptions give
Young/Daly's checkpoint interval and the expected preemptions, lost work and total time
(docs/design.md §29). Bad input exits 2 with an error naming the flag.
"""

import argparse
import sys

from megalite.arguments import parse_args
from megalite.cost.estimate import plan_lines
from megalite.errors import ConfigError, MegaliteError
from megalite.validation import validate_model_args
from megalite.validation.schedule import run_length


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Every other flag is pretrain_gpt.py's (python pretrain_gpt.py --help).")
    add = parser.add_argument
    add("--gpu", required=True, help="GPU kind, as megalite/monitoring/peak_flops.py names "
                                     "it (A100, H100 SXM, H200, B200, ...).")
    add("--num-gpus", type=int, required=True, help="GPUs in the run (TP x PP x CP x DP).")
    add("--gpus-per-node", type=int, default=8, help="For the nodes a preemption takes "
                                                     "(default 8).")
    add("--mfu", type=float, default=None,
        help="Model FLOPs utilisation, a fraction in (0, 1] (0.4 for 40%%).")
    add("--cluster-report", default=None,
        help="A tools/check_cluster.py REPORT.md: its --tune table's fastest MFU (unless "
             "--mfu) and its checkpoint phase's save rate per rank (unless --save-gbps).")
    add("--train-tokens", type=float, default=None,
        help="Training tokens (else --train-iters or --train-samples x the global batch).")
    add("--prices", default=None, help="A price table of megalite/cost/prices.yaml's shape.")
    add("--offer", default=None, help="Which of the table's offers for --gpu (its first).")
    add("--on-demand-price", type=float, default=None, help="USD per GPU-hour on demand.")
    add("--spot-price", type=float, default=None, help="USD per GPU-hour on spot.")
    add("--preemption-rate", type=float, default=None,
        help="Spot preemptions per node-hour (0.05: one a node every 20 hours).")
    add("--save-seconds", type=float, default=None,
        help="A measured save time (else planned from the checkpoint's bytes).")
    add("--save-gbps", type=float, default=None,
        help="Write rate of one rank, GB/s, for the planned save time (default: "
             "--cluster-report's, else 0.32, measured in docs/benchmarks.md).")
    add("--checkpoint-interval-minutes", type=float, default=None,
        help="Plan spot at this interval (default: Young/Daly's optimum).")
    add("--restart-minutes", type=float, default=0.0,
        help="Minutes from a preemption until training runs again (default 0).")
    return parser


def check_positive(tool_args, *names: str) -> None:
    for name in names:
        value = getattr(tool_args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value:g}")


def run_tokens(tool_args, args, config) -> tuple[float, str]:
    """The run's training tokens and the flags that gave them."""
    if tool_args.train_tokens is not None:
        return tool_args.train_tokens, "--train-tokens"
    if args.train_iters is None and args.train_samples is None:
        raise ConfigError("give --train-tokens, or --train-iters or --train-samples (with "
                          "the run's --global-batch-size)")
    batch = config.training.global_batch_size
    iters, samples = run_length(args, batch)
    return samples * config.model.seq_length, (
        f"{iters} iterations x global batch {batch} x {config.model.seq_length} tokens")


def main(argv=None) -> int:
    tool_args, train_argv = build_parser().parse_known_args(argv)
    try:
        check_positive(tool_args, "num_gpus", "gpus_per_node", "train_tokens", "on_demand_price",
                       "spot_price", "preemption_rate", "save_seconds", "save_gbps",
                       "checkpoint_interval_minutes")
        if tool_args.restart_minutes < 0:
            raise ConfigError(f"--restart-minutes must be >= 0, got {tool_args.restart_minutes:g}")
        args = parse_args(train_argv)
        config = validate_model_args(args, tool_args.num_gpus, args.vocab_size)
        tokens, tokens_from = run_tokens(tool_args, args, config)
        print("\n".join(plan_lines(config, tool_args, tokens, tokens_from)))
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
