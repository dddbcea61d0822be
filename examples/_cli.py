"""What the three two-process examples share (not part of the package): their
command line's common options, the checks of ``--listen`` / ``--peer``, the
``--peer`` value the listening side prints for the other one, a digest of a
request's tensors, and running the chosen role with every failure turned
into one ``error:`` line.

Each example runs as a script (``python examples/push_flow.py``), so this
file is found beside it on ``sys.path``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

import aiokvcache as kv
from aiokvcache.options import TRANSPORTS
from aiokvcache.testing import PeerExited


class Failed(Exception):
    """A check of an example failed (its message is the error line)."""


def digest(tensors: list[np.ndarray]) -> str:
    """sha256 over the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(np.ascontiguousarray(t).tobytes())
    return h.hexdigest()


def base_parser(
    prog: str, doc: str | None, listener: str, connector: str, listener_noun: str
) -> argparse.ArgumentParser:
    """The options every two-process example has: ``--role`` (``both``, the
    ``listener`` side or the ``connector`` side), ``--listen``, ``--peer`` and
    ``--transport``; the module docstring up to "run it:" is the description,
    the rest the epilog. ``listener_noun`` names the listening side in help."""
    description, sep, epilog = str(doc).partition("run it:\n")
    ap = argparse.ArgumentParser(
        prog=prog,
        description=description.strip(),
        epilog=sep + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--role",
        choices=["both", listener, connector],
        default="both",
        help=f"both: the whole flow on this machine; {listener} / {connector}: one side, for two "
        "hosts (default: %(default)s)",
    )
    ap.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help=f"{listener}: the address to listen on; port 0 picks a free one "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--peer",
        metavar="IPV4:PORT",
        help=f"{connector} (required): {listener_noun}'s address, as {listener_noun} printed it",
    )
    return ap


def add_transport(ap: argparse.ArgumentParser) -> None:
    """``--transport``, in the place each example's help lists it."""
    ap.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="the UCX transports for the bytes: auto lets UCX choose (shared memory on "
        "one host); shm, tcp or rdma (InfiniBand verbs) forces one (default: %(default)s)",
    )


def check_address(ap: argparse.ArgumentParser, option: str, value: str) -> None:
    """``--listen`` as LLMConfig checks it (a host name or [IPv6] will do),
    ``--peer`` as LLMClusterInfo does (IPv4:PORT)."""
    try:
        if option == "--listen":
            kv.LLMConfig().listen_ip_info = value
            return
        ip, sep, port = value.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"expected IPV4:PORT, got {value!r}")
        kv.LLMClusterInfo().append_remote_ip_info(ip, int(port))
    except ValueError as exc:
        ap.error(f"{option}: {exc}")


def peer_argument(address: str | None, placeholder: str) -> str:
    """What to pass as ``--peer`` to reach ``address``: the placeholder for
    the IP where it is a wildcard or not an IPv4 address."""
    ip, _, port = str(address).rpartition(":")
    try:
        kv.LLMClusterInfo().append_remote_ip_info(ip, int(port))
    except ValueError:
        ip = placeholder
    return f"{placeholder if ip == '0.0.0.0' else ip}:{port}"


def run_role(
    ap: argparse.ArgumentParser,
    args: argparse.Namespace,
    listener: tuple[str, Callable[[], Coroutine[Any, Any, Any]]],
    connector: tuple[str, Callable[[], Coroutine[Any, Any, Any]]],
    both: Callable[[], None],
) -> int:
    """Run ``args.role``: the listening side (``--listen`` checked), the
    connecting side (``--peer`` required and checked), or both on this
    machine. The exit status; a failure is one line on stderr."""
    try:
        if args.role == listener[0]:
            check_address(ap, "--listen", args.listen)
            asyncio.run(listener[1]())
        elif args.role == connector[0]:
            if not args.peer:
                ap.error(f"--peer IPV4:PORT is required with --role {connector[0]}")
            check_address(ap, "--peer", args.peer)
            asyncio.run(connector[1]())
        else:
            both()
    except kv.LLMException as exc:
        print(f"error: {exc.status_code.name}: {exc.message}", file=sys.stderr)
        return 1
    except (Failed, PeerExited, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
