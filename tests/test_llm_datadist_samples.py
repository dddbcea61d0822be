"""LLM-DataDist's four Python samples, ported (``examples/llm_datadist/``),
run as their two processes with the original command line, over shm and tcp.

Their barrier blocks each side's event loop between calls, as gloo's does
in the originals; aiokvcache still serves the blocked peer. Each run checks
both exit codes, the bytes each side logs, and that nothing was logged at
ERROR or as a traceback. The samples use fixed ports (26000, 26001, 29500),
so they run one at a time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parent.parent / "examples" / "llm_datadist"
ONE, ZERO = [1.0] * 10, [0.0] * 10
# sample -> (role, log prefix) -> the rows that side's tensors must hold.
EXPECTED = {
    "push_cache_sample.py": {("p", "after decoder push"): [ONE, ZERO, ZERO]},
    "push_blocks_sample.py": {("p", "after decoder push"): [ZERO, ONE, ZERO]},
    "transfer_cache_async_sample.py": {("d", "after prompt transfer"): [ONE, ZERO, ZERO]},
    "switch_role_sample.py": {
        ("d", "after pull"): [ONE, ZERO, ONE],
        ("p", "after decoder push"): [ONE, ZERO, ONE],
    },
}
RUN_TIMEOUT = 90


def run_sample(name: str, transport: str) -> dict[str, str]:
    env = {**os.environ, "AIOKVCACHE_TRANSPORT": transport, "PYTHONUNBUFFERED": "1"}
    args = ["--local_host_ip", "127.0.0.1", "--remote_host_ip", "127.0.0.1"]
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(SAMPLES / name), "--role", role, *args],
            cwd=SAMPLES,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role in ("p", "d")
    }
    out: dict[str, str] = {}
    try:
        for role, proc in procs.items():
            out[role], _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for role, proc in procs.items():
        assert proc.returncode == 0, f"{name} --role {role} exited {proc.returncode}:\n{out[role]}"
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_runs_unchanged_but_await(name: str, transport: str) -> None:
    out = run_sample(name, transport)
    for text in out.values():
        assert "Sample end" in text, text
        assert "Traceback" not in text and " ERROR " not in text, text
        assert "ignoring" not in text, text  # no blame for the library's own keys
    for (role, prefix), rows in EXPECTED[name].items():
        for tensor in ("tensor", "tensor2"):
            m = re.search(rf"{prefix}, {tensor}=(\[.*\])$", out[role], re.MULTILINE)
            assert m, f"no '{prefix}, {tensor}=' line from --role {role}:\n{out[role]}"
            assert json.loads(m.group(1)) == rows, out[role]
