"""The examples and the main job run as a user would run them: two processes each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], timeout: float = 90) -> str:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_push_flow(transport: str) -> None:
    out = run([str(ROOT / "examples" / "push_flow.py"), "--transport", transport])
    assert "decoder bytes match" in out


def test_pull_flow(transport: str) -> None:
    out = run([str(ROOT / "examples" / "pull_flow.py"), "--transport", transport])
    assert "bytes match" in out
