"""Command line: ``python -m aiokvcache bench | info | demo``.

``bench`` is the main job (:mod:`aiokvcache.bench`): it starts a decode
process, then (in this process, the prefill side) pushes a model-shaped KV
cache to it layer by layer while simulating per-layer compute, and prints
bandwidth, per-layer latency and how much of the transfer was hidden behind
compute. ``info`` and ``demo`` live in :mod:`aiokvcache.info`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from . import LLMException, bench
from .testing import PeerError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aiokvcache", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    bench.add_arguments(
        sub.add_parser("bench", help="push a KV cache layer by layer to a decode process")
    )
    sub.add_parser("info", help="versions and the transports UCX offers here")
    sub.add_parser("demo", help="push and pull a tiny cache between two instances")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m aiokvcache``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_decode"]:
        # Internal and unlisted, kept for older callers: the bench's decode
        # side, now ``python -m aiokvcache._peer decode``.
        from . import _peer

        return _peer.main(["decode", *argv[1:]])
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            from .info import info

            return info()
        if args.command == "demo":
            from .info import demo

            return asyncio.run(demo())
        problem = bench.check_arguments(args)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        return bench.main(args)
    except (LLMException, PeerError, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
