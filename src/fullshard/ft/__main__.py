"""`python -m fullshard.ft --bind ADDR [--port P] [--min-replicas N]`: a lighthouse for replica
groups on other machines (torchrun or SLURM launch lines: docs/fault-tolerance.md). It prints
the address to give the groups, then serves until stopped (SIGINT or SIGTERM)."""

from __future__ import annotations

import argparse
import signal
import sys

from fullshard.errors import FullShardError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fullshard.ft", description=__doc__)
    parser.add_argument("--bind", default="127.0.0.1", help="the IP address to listen on (Note [one address])")
    parser.add_argument("--port", type=int, default=29510, help="the port (0: any free one)")
    parser.add_argument("--min-replicas", type=int, default=1, help="the fewest replica groups a step commits with")
    args = parser.parse_args(argv)
    # before the address is printed: a supervisor may stop it as soon as it reads the line
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        from fullshard.ft.network import Lighthouse

        lighthouse = Lighthouse(args.bind, args.port, min_replicas=args.min_replicas)
    except FullShardError as e:
        print(f"fullshard: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"lighthouse at {lighthouse.address()}: pass it to every replica group as lighthouse_addr "
          f"(or TORCHFT_LIGHTHOUSE)", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
