"""Train with pretrain_gpt.py's ranks as Ray actors, the group restarted from the newest
checkpoint when a worker is lost (issue 45; megalite/ray_launch.py, examples/ray/).

    python tools/ray_launch.py --address auto --num-workers 16 --gpus-per-worker 1 \\
        --max-failures 10 -- <pretrain_gpt.py flags> --save ckpt --load ckpt

The flags after `--` are pretrain_gpt.py's; --save and --load must name the same
directory (on storage every node sees), so a restarted group resumes. Needs Ray:
pip install 'megalite[ray]'.
"""

import argparse
import sys

from megalite.errors import MegaliteError
from megalite.ray_launch import Launch, launch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add = parser.add_argument
    add("--address", default=None,
        help="The Ray cluster (ray.init's address: 'auto', host:port); default: a local one.")
    add("--num-workers", type=int, required=True, help="Ranks (pretrain_gpt.py's world size).")
    add("--cpus-per-worker", type=float, default=1.0, help="CPUs of each rank's bundle.")
    add("--gpus-per-worker", type=float, default=0.0, help="GPUs of each rank's bundle (1 on "
                                                            "a GPU cluster).")
    add("--strategy", default="SPREAD", choices=["SPREAD", "STRICT_SPREAD", "PACK",
                                                 "STRICT_PACK"],
        help="Ray's placement strategy for the ranks' bundles (default SPREAD: a lost node "
             "takes as few ranks as it can; ranks are numbered node by node either way).")
    add("--max-failures", type=int, default=3,
        help="Group restarts after a lost or failed rank, or a signal that stopped training "
             "early (-1: no limit; Ray Train's FailureConfig(max_failures)).")
    add("--placement-timeout", type=float, default=600.0,
        help="Seconds to wait for room for the group (a replacement node), default 600.")
    add("train_argv", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py's flags.")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    train_argv = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    try:
        if args.num_workers <= 0:
            raise MegaliteError(f"--num-workers must be positive, got {args.num_workers}")
        return launch(train_argv, Launch(args.num_workers, args.cpus_per_worker,
                                         args.gpus_per_worker, args.strategy,
                                         args.max_failures, args.placement_timeout),
                      args.address)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
