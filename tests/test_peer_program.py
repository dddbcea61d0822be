"""The peer program, ``python -m aiokvcache.testing.peer``, and its ``--ops`` hook.

What its docstring and docs/testing.md promise the modules it loads and
its users: an ops module sees the peer's own state through
``aiokvcache.testing.peer`` (``service_errors()``: what its health reports,
and what the fuzz tests hold a victim to), ``--lifetime`` holds whatever
happens (a module still loading included), and the command line users had
before ``--ops`` still reads the same.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

from aiokvcache.testing import JsonPeer, peer_argv
from support.harness import ops_spec

#: An ops module that logs an error where the peer's health looks (a
#: peer-service logger) and answers what ``service_errors()`` says, imported
#: as the peer program's docs tell an ops module to.
LOG_OPS = """
import logging

from aiokvcache.testing.peer import service_errors


def register(ops, node):
    async def log_error(req):
        logging.getLogger("aiokvcache.service.test").error("boom from an op")
        return {"logged": True}

    async def seen(req):
        return {"seen": service_errors()}

    ops.update(log_error=log_error, seen=seen)
"""


def _module(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_an_ops_module_sees_the_service_errors_the_peer_reports(tmp_path: Path) -> None:
    """``service_errors()`` imported from ``aiokvcache.testing.peer`` by an ops
    module is the record the peer's own ``health`` reads. Run as ``-m``, the
    program is ``__main__``: the module's import made a second copy of it,
    whose record nothing watches, so it is always empty."""
    spec = _module(tmp_path, "peer_ops_log_a", LOG_OPS)
    argv = peer_argv("decoder", "tcp", ops=[spec], lifetime=60)
    with JsonPeer(argv, label="peer decoder (log)") as peer:
        peer.call("log_error")
        health = peer.call("health")["service_errors"]
        assert any("boom from an op" in e for e in health), health  # the peer saw it
        seen = peer.call("seen")["seen"]
        assert seen == health, f"the ops module's service_errors() {seen} != health's {health}"


def test_the_agent_victims_health_names_an_error_its_service_logged(tmp_path: Path) -> None:
    """tests/test_peer_input_fuzz.py's connector victim (ROLE none, the agent
    ops) is held to ``health``'s ``service_errors`` being empty: they must
    name what reached its service loggers, or that check passes whatever
    the fuzzing did (peer_modes' agent mode, before, read the watched record)."""
    spec = _module(tmp_path, "peer_ops_log_b", LOG_OPS)
    argv = peer_argv("none", "tcp", "--cluster-id=3", ops=[ops_spec("agent"), spec], lifetime=60)
    with JsonPeer(argv, label="peer none (agent, log)") as victim:
        victim.call("log_error")
        health = victim.call("health")
        assert any("boom from an op" in e for e in health["service_errors"]), health


def test_the_lifetime_holds_while_an_ops_module_loads(tmp_path: Path) -> None:
    """``--lifetime`` ends the peer "whatever happens". The watchdog is armed
    only after every ``--ops`` module was imported (and its options added):
    a module whose import hangs keeps the peer alive past its lifetime, and
    past its parent's death."""
    spec = _module(
        tmp_path,
        "peer_ops_stuck",
        """
        import time

        time.sleep(60)  # an import that hangs (a device, a lock, a network mount)


        def register(ops, node):
            pass
        """,
    )
    lifetime = 2.0
    proc = subprocess.Popen(
        peer_argv("none", "tcp", ops=[spec], lifetime=lifetime),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        start = time.monotonic()
        try:
            proc.wait(timeout=lifetime + 8)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the peer (lifetime={lifetime}) still runs "
                f"{time.monotonic() - start:.0f} s after it started"
            ) from None
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdin is not None
        proc.stdin.close()


def test_an_abbreviated_options_flag_still_reads_as_options() -> None:
    """Before ``--ops``, ``--op=JSON`` was argparse's abbreviation of the only
    flag it prefixes, ``--options``. The pre-parse of ``--ops`` now takes it
    as an ops module's name and the peer dies importing ``{"peer_timeout"...``
    (or, were it unambiguous only for ``--ops``, it should say so as an
    argparse usage error, not a traceback)."""
    argv = peer_argv("decoder", "tcp", '--op={"peer_timeout": 1000}', lifetime=60)
    proc = subprocess.run(argv, input=b'{"op": "exit"}\n', capture_output=True, timeout=60)
    err = proc.stderr.decode(errors="replace")
    assert "ModuleNotFoundError" not in err, err[-800:]
    # Either it ran as before (its hello), or argparse refused it as ambiguous (exit 2).
    assert proc.returncode in (0, 2), (proc.returncode, err[-800:])
