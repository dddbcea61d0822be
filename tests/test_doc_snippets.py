"""Every code block of the README and of ``docs/`` works as written.

* Each ```python block is a complete program: it runs, in a fresh process,
  on this machine (two instances on 127.0.0.1), and exits 0.
* Each command line in a ```bash block that starts one of ours —
  ``python -m aiokvcache ...``, ``python examples/...``, ``python
  benchmarks/...`` — names something that exists and parses: it runs with
  ``--help`` added (``info`` and ``demo`` run in full: they are quick). The
  long runs themselves are tested elsewhere (test_cli, test_examples).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support import etcd

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for n, m in enumerate(FENCE.finditer(text)):
            if m.group(1) == lang:
                line = text[: m.start()].count("\n") + 1
                out.append((f"{page.relative_to(ROOT)}:{line}#{n}", m.group(2)))
    return out


PYTHON = blocks("python")
SHELL = blocks("bash")


def test_the_pages_have_blocks() -> None:
    assert any(name.startswith("README.md") for name, _ in PYTHON)
    assert any(name.startswith("README.md") for name, _ in SHELL)


@pytest.mark.parametrize(("name", "code"), PYTHON, ids=[n for n, _ in PYTHON])
def test_python_block_runs(name: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    with contextlib.ExitStack() as stack:
        env = dict(os.environ)
        if "ETCD_ENDPOINT" in code:  # the discovery examples get a real etcd
            (tmp_path / "etcd").mkdir()
            env["ETCD_ENDPOINT"] = stack.enter_context(etcd.etcd_server(tmp_path / "etcd"))
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,
            env=env,
        )
    assert proc.returncode == 0, f"{name}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr


def commands(code: str) -> list[tuple[Path, list[str]]]:
    """(directory, argv) of each of our commands in a shell block, following ``cd``."""
    cwd = ROOT
    out = []
    for raw in code.replace("\\\n", " ").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|;|(?<!&)&(?!&)", line):
            argv = shlex.split(part.strip())
            if not argv:
                continue
            if argv[0] == "cd":
                cwd = (cwd / argv[1]).resolve()
            elif argv[0] in ("python", "python3") and len(argv) > 1:
                if argv[1] == "-m" and argv[2:3] == ["aiokvcache"]:
                    out.append((cwd, argv[1:]))
                elif argv[1].endswith(".py"):
                    out.append((cwd, argv[1:]))
    return out


SHELL_COMMANDS = [
    (f"{name}:{' '.join(argv)}", cwd, argv) for name, code in SHELL for cwd, argv in commands(code)
]


@pytest.mark.parametrize(
    ("name", "cwd", "argv"), SHELL_COMMANDS, ids=[n for n, _, _ in SHELL_COMMANDS]
)
def test_shell_command_exists_and_parses(name: str, cwd: Path, argv: list[str]) -> None:
    if argv[0].endswith(".py"):
        assert (cwd / argv[0]).is_file(), f"{name}: no such file {cwd / argv[0]}"
    quick = argv[:3] in (["-m", "aiokvcache", "info"], ["-m", "aiokvcache", "demo"])
    run = argv if quick else [*argv, "--help"]
    proc = subprocess.run(
        [sys.executable, *run], capture_output=True, text=True, timeout=90, cwd=cwd
    )
    assert proc.returncode == 0, f"{name}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
