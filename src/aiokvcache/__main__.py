"""Command line: ``python -m aiokvcache bench | info | demo`` (also ``aiokvcache ...``).

``bench`` is the main job (:mod:`aiokvcache.bench`); ``info`` and ``demo``
live in :mod:`aiokvcache.info`. Errors are one line — the status name, what
happened, what to try — and a traceback only with ``--debug``; UCX's own log
lines go through the ``aiokvcache.ucx`` logger, shown with ``--debug``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback

from . import LLMException, LLMStatusCode, bench
from ._child import PeerError

DESCRIPTION = """\
aiokvcache moves LLM KV caches between processes and hosts from asyncio.
These commands try it out on this machine."""

EPILOG = """\
examples:
  python -m aiokvcache info                    versions and the transports UCX offers here
  python -m aiokvcache demo                    a tiny push and pull between two instances
  python -m aiokvcache bench                   the main job: a 32-layer cache, layer by layer
  python -m aiokvcache bench --help            its options

Documentation: docs/ in the source tree (mkdocs serve)."""

#: What to try, per status, after the one-line error.
HINTS: dict[LLMStatusCode, str] = {
    LLMStatusCode.LLM_FEATURE_NOT_ENABLED: (
        "this transport cannot start here; `python -m aiokvcache info` lists what this "
        "machine offers (try --transport shm or tcp)"
    ),
    LLMStatusCode.LLM_LINK_FAILED: (
        "the peer did not answer: is it running, and is its port reachable?"
    ),
    LLMStatusCode.LLM_TIMEOUT: (
        "the machine may be overloaded; try fewer layers or a longer timeout"
    ),
    LLMStatusCode.LLM_PARAM_INVALID: "check the options (--help lists them with their defaults)",
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help (not for flags), descriptions kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aiokvcache",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks and every log line, UCX's own included",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{bench,info,demo}")
    bench.add_arguments(
        sub.add_parser(
            "bench",
            help="push a KV cache layer by layer to a decode process, beside simulated compute",
            description=bench.DESCRIPTION,
            epilog=bench.EPILOG,
            formatter_class=_Formatter,
        )
    )
    sub.add_parser(
        "info",
        help="versions and the transports UCX offers here",
        description="Print the versions in use and, per transport, what UCX offers here.",
        formatter_class=_Formatter,
    )
    sub.add_parser(
        "demo",
        help="push and pull a tiny cache between two instances",
        description="Link two instances in this process, push a tiny cache, pull it back by key.",
        formatter_class=_Formatter,
    )
    return p


def _setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    root = logging.getLogger("aiokvcache")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
    # UCX's warnings (e.g. "transport 'ib' is not available") are noise for
    # a command line that reports availability itself; --debug shows them.
    logging.getLogger("aiokvcache.ucx").setLevel(logging.DEBUG if debug else logging.ERROR)


def _error(exc: BaseException) -> str:
    if isinstance(exc, LLMException):
        code = exc.status_code
        text = f"error: {code.name}: {exc.message}"
        hint = HINTS.get(code)
        return f"{text}\n  hint: {hint}" if hint else text
    if isinstance(exc, PeerError):
        last = [line for line in str(exc).splitlines() if line.strip()]
        return f"error: the decode process failed: {last[-1] if last else exc}"
    return f"error: {exc}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m aiokvcache``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    _setup_logging(args.debug)
    try:
        if args.command == "info":
            from .info import info

            return info()
        if args.command == "demo":
            from .info import demo

            return asyncio.run(demo())
        problem = bench.check_arguments(args)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        return bench.main(args)
    except (LLMException, PeerError, OSError, TypeError, ValueError) as exc:
        if args.debug:
            traceback.print_exc()
        print(_error(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
