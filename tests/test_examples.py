"""The examples and the main job run as a user would run them: two processes each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    ("compute", "blocks"),
    [("sleep", 0), ("busy", 0), ("sleep", 16)],
    ids=["sleep", "busy", "paged"],
)
def test_bench_main_job_small(transport: str, compute: str, blocks: int) -> None:
    out = run(
        [
            "-m",
            "aiokvcache",
            "bench",
            "--layers=4",
            "--tokens=256",
            "--iterations=2",
            f"--transport={transport}",
            f"--compute={compute}",
            f"--blocks={blocks}",
        ]
    )
    assert "decode side bytes verified   yes" in out
    assert "overlap (transfer hidden)" in out


def test_info_and_demo() -> None:
    assert "transport tcp" in run(["-m", "aiokvcache", "info"])
    assert "pulled by CacheKey" in run(["-m", "aiokvcache", "demo"])


@pytest.mark.parametrize(("arg", "flag"), [("--layers=0", "--layers"), ("--blocks=7", "--blocks")])
def test_bench_rejects_bad_arguments(arg: str, flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aiokvcache", "bench", arg],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and flag in proc.stderr
