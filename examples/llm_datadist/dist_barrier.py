"""A stand-in for the two calls of ``torch.distributed`` the LLM-DataDist
samples use: ``init_process_group`` and ``barrier``.

Like gloo's, both block the calling thread — in these ports, the event loop
itself, which is the point: aiokvcache serves its peers from its own service
thread, so a peer blocked in a barrier still answers links, metadata
requests and transfers. Rank 0 listens on ``MASTER_ADDR:MASTER_PORT`` (set
by the sample, as for torch) and the others connect; a barrier returns once
every rank has entered it. Only the standard library, TCP on the given
address.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

_state: dict[str, object] = {}


def init_process_group(
    backend: str = "gloo",
    rank: int = 0,
    world_size: int = 2,
    timeout: datetime.timedelta = datetime.timedelta(seconds=30),
) -> None:
    """Join the group: rank 0 waits for the others, the others connect to it."""
    del backend  # TCP only
    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds
    peers: list[socket.socket] = []
    if rank == 0:
        with socket.create_server((host, port)) as server:
            server.settimeout(seconds)
            while len(peers) < world_size - 1:
                conn, _ = server.accept()
                conn.settimeout(seconds)
                peers.append(conn)
    else:
        while True:
            try:
                conn = socket.create_connection((host, port), timeout=seconds)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no rank 0 at {host}:{port} within {seconds:.0f} s"
                    ) from None
                time.sleep(0.05)
        conn.settimeout(seconds)
        peers.append(conn)
    _state.update(rank=rank, peers=peers)


def _recv_byte(conn: socket.socket) -> None:
    if conn.recv(1) != b"B":
        raise ConnectionError("a rank left the group")


def barrier() -> None:
    """Block until every rank has called it (the count pairs them up)."""
    peers = _state.get("peers")
    if not isinstance(peers, list):
        raise RuntimeError("call init_process_group() first")
    if _state["rank"] == 0:
        for conn in peers:
            _recv_byte(conn)
        for conn in peers:
            conn.sendall(b"B")
    else:
        peers[0].sendall(b"B")
        _recv_byte(peers[0])


def destroy_process_group() -> None:
    """Close the group's sockets."""
    for conn in _state.pop("peers", []):  # type: ignore[attr-defined]
        conn.close()
