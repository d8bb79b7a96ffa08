"""The Lighthouse that live recovery's replica groups form their per-step quorum through (torchft's, in Rust):

    python -m runtime.lighthouse --port 29510 [--host 127.0.0.1] [--min-groups 1]

Runs until SIGTERM or SIGINT; a restarted Lighthouse is found again by the groups, which wait for it
up to ft.quorum_timeout_s (docs/fault_tolerance.md).
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.lighthouse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="the port the groups' ft.lighthouse names")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s; 0.0.0.0 for other machines)")
    parser.add_argument("--min-groups", type=int, default=1, help="the fewest groups a quorum may have (default: %(default)s)")
    parser.add_argument("--join-timeout-ms", type=int, default=10000,
                        help="how long a quorum waits for a live group that has not asked yet (default: %(default)s; a dead or hung "
                             "group stops its heartbeat and is not waited for)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                        help="a group silent this long is left out of the next quorum (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536 or args.min_groups < 1:
        print(f"error: --port must be 1..65535 and --min-groups at least 1 (got {args.port}, {args.min_groups})", file=sys.stderr)
        return 2
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        print("error: live recovery needs torchft (pip install torchft==0.2.0; requirements.txt)", file=sys.stderr)
        return 2
    try:
        server = LighthouseServer(bind=f"{args.host}:{args.port}", min_replicas=args.min_groups, join_timeout_ms=args.join_timeout_ms,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as e:  # noqa: BLE001 - the bind failed (port taken, bad address): said in one line
        print(f"error: the Lighthouse cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"lighthouse: listening on {args.host}:{args.port} (min groups {args.min_groups})", flush=True)
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
