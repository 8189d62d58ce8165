"""A rendezvous store for torchrun's c10d backend in a process of its own, so that losing any
training node leaves the job able to restart (docs/guide.md, "Restarts that survive losing
any node").

With `--rdzv-backend c10d --rdzv-endpoint $HEAD:PORT`, the torchrun agent on $HEAD hosts the
store inside itself: if that node dies, every other agent loses the store and ends ("The
connection to the C10d store has failed"). Run this on a host that trains nothing (a login
or service node reachable from the nodes) and start every agent with
`--rdzv-endpoint STORE_HOST:PORT --rdzv-conf is_host=0`: the agents only connect to it, and
the survivors of any node's loss meet again there.

    python tools/rendezvous_store.py --port 29500

Runs until killed (SIGTERM/SIGINT end it cleanly). It holds only the rendezvous' keys, a
few kilobytes.
"""

import argparse
import signal
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=29500, help="TCP port to listen on.")
    p.add_argument("--timeout-s", type=float, default=3600.0,
                   help="How long a client's request may wait for a key (seconds).")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        print(f"error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        # is_master: this process serves the store; clients (the agents) never host it.
        store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=args.timeout_s))
    except (RuntimeError, OSError) as error:
        print(f"error: cannot listen on port {args.port}: {error}", file=sys.stderr)
        return 1
    print(f"rendezvous store listening on port {store.port}; start every torchrun with "
          f"--rdzv-endpoint <this host>:{store.port} --rdzv-conf is_host=0", flush=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
