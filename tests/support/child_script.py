"""A test's own short program run in a fresh interpreter, for what only a
whole run can show: how it ends (a hang, Ctrl-C, the run's end cancelling
what is left, the process dying hard)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_child(code: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str] | None:
    """Run ``code`` in a fresh interpreter; None when it is still running after ``timeout``."""
    script = tmp_path / "child.py"
    # Ctrl-C as an interactive run has it, whatever this process inherited:
    # a run started in the background of a non-interactive shell ignores
    # SIGINT, its children inherit that, and Python (so trio) then turns no
    # SIGINT into a KeyboardInterrupt.
    default_sigint = "import signal as _s\n_s.signal(_s.SIGINT, _s.default_int_handler)\n"
    script.write_text(default_sigint + textwrap.dedent(code))
    log = tmp_path / "child.log"
    # Output to a file, not a pipe: a grandchild that inherits it must not
    # keep us waiting for end of file.
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")
