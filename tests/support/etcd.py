"""A real etcd for the discovery tests: the one CI started
(``AIOKVCACHE_TEST_ETCD=host:port``), else one started here from Debian's
``etcd-server`` binary; the tests skip, saying why, when neither exists."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "AIOKVCACHE_TEST_ETCD"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(endpoint: str) -> bool:
    """etcd at ``endpoint`` answers its /health with health true."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=2) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def etcd_server(data_dir: Path) -> Iterator[str]:
    """``host:port`` of a running etcd, for the block."""
    given = os.environ.get(ENV)
    if given:
        if not healthy(given):
            pytest.fail(f"{ENV}={given} names no healthy etcd")
        yield given
        return
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary (Debian: apt-get install etcd-server), and no " + ENV)
    client, peer = _free_port(), _free_port()
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = open(data_dir / "etcd.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            "--name=akv-test",
            f"--data-dir={data_dir / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=akv-test={peer_url}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"127.0.0.1:{client}"
    try:
        deadline = time.monotonic() + 30
        while not healthy(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"etcd did not start: {(data_dir / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def get(endpoint: str, key: str) -> dict[str, object] | None:
    """The JSON value at ``key`` (etcd's v3 JSON gateway), or None."""
    import base64

    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        kvs = json.loads(resp.read()).get("kvs") or []
    if not kvs:
        return None
    value: dict[str, object] = json.loads(base64.b64decode(kvs[0]["value"]))
    return value


#: The lease the discovery tests give instances (seconds).
TEST_TTL = 2


def instance_options(endpoint: str, prefix: str, **extra: object) -> dict[str, object]:
    """LLMConfig attributes for an instance registered at ``endpoint`` under ``prefix``."""
    return {"etcd_endpoint": endpoint, "etcd_prefix": prefix, "etcd_lease_ttl": TEST_TTL, **extra}


def by_id(cluster_id: int) -> object:
    """A cluster named by its id alone: its address is etcd's business."""
    from aiokvcache import LLMClusterInfo

    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    return info
