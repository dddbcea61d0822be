"""Review of three commits: the vLLM connector's figures from aiokvcache's
per-call records (integrations/_calls.py), the warm-up at init
(ext/prewarm.cpp, ``aiokvcache.prewarm``) and the layering test's leaves
(tests/test_layout.py). Each test fails on the reviewed code and passes once
the defect it names is fixed."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiokvcache import _telemetry, metrics

# ---------------------------------------------------------------------------
# 1. The connector's process-wide sink makes aiokvcache.metrics.enabled() lie.
#
# metrics.enabled() is documented as "True while any record sink is on (this
# module's or yours)"; metrics.disable() as "Stop recording (this module's
# sinks; yours stay)". While a TransferAgent runs, _calls.attach() registers
# the connector's own internal sink through the same public add_sink, so
# after enable() + disable() -- or without either -- enabled() says True
# although neither this module's sinks nor any of the user's is on. Code that
# enables metrics only when they are off ("if not metrics.enabled():
# metrics.enable()") never registers its collector in a vLLM process.
# ---------------------------------------------------------------------------


def test_metrics_enabled_is_false_after_disable_while_an_agent_runs() -> None:
    from test_kvlink import Side

    assert not metrics.enabled(), "another test left a sink on"
    side = Side("review-stats", "tcp", timeout=5.0, grace=1.0)
    try:
        assert _telemetry.active  # the agent's records are being made
        assert not metrics.enabled(), "enabled() before anyone enabled metrics"
        metrics.enable(prometheus=False, tracing=False)
        assert metrics.enabled()
        metrics.disable()
        assert not metrics.enabled(), (
            "metrics.disable() was called and no user sink is on, yet "
            "metrics.enabled() is True: the connector's internal sink counts as one"
        )
    finally:
        metrics.disable()
        side.agent.close()
    assert not _telemetry.active


# ---------------------------------------------------------------------------
# 2. A warm-up under file-descriptor pressure poisons the process.
#
# prewarm.cpp claims "whatever fails or takes too long leaves the engine
# exactly as it would be without it". Over tcp the helper worker opens its
# own listening socket and connections inside this process; when the
# process is near RLIMIT_NOFILE the helper's accept() fails, the flush ends
# with "Endpoint timeout", and destroying the helper leaves UCX async
# handlers registered on fd ids that are closed ("handler ... not released",
# "failed to remove handler for server socket fd=-1"). From then on the
# global async thread (a pipe and an epoll fd) stays, and a later engine --
# prewarm off -- whose sockets land on those fd numbers fails with
# "ucp_worker_create: Element already exists", or hangs, or the process
# segfaults. Without the warm-up the same limits make engine creation fail
# cleanly (UcxError) and leave nothing behind: the control run below.
# ---------------------------------------------------------------------------

_SCAN = textwrap.dedent(
    """
    import os, re, resource, sys
    from aiokvcache._loader import native

    transport, prewarm = sys.argv[1], sys.argv[2] == "1"

    def fds():
        out = []
        for f in os.listdir("/proc/self/fd"):
            try:
                t = os.readlink(f"/proc/self/fd/{f}")
            except OSError:
                continue
            if t != "anon_inode:[eventfd]":  # one UCX keeps across engines
                out.append(re.sub(r"\\[\\d+\\]", "", t))
        return sorted(out)

    native.Engine(transport, prewarm=prewarm).close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    base = fds()
    # Headroom from 6 fds up (fewer trips a UCX assertion with or without
    # the warm-up: not what this checks) to plenty.
    for k in range(6, 41):
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + k, hard))
        try:
            native.Engine(transport, prewarm=prewarm).close()
        except native.NativeError:
            pass  # may fail to start: cleanly is all that is asked
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if fds() != base:
            print(f"LEAK with {k} fds of headroom: {fds()} (was {base})")
            sys.exit(3)
        for pad in range(12):  # later engines, their fds at every offset
            extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(pad)]
            try:
                native.Engine(transport).close()
            except native.NativeError as exc:
                print(f"LATER ENGINE FAILED after {k} fds of headroom, pad {pad}: {exc}")
                sys.exit(4)
            finally:
                for f in extra:
                    os.close(f)
    print("clean")
    """
)


def _scan(transport: str, prewarm: bool) -> tuple[int | str, str]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SCAN, transport, "1" if prewarm else "0"],
            capture_output=True,
            text=True,
            timeout=150,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return "hung", out
    return done.returncode, (done.stdout + done.stderr)[-3000:]


@pytest.mark.timeout(400)
def test_a_prewarm_under_fd_pressure_leaves_the_process_as_without_it() -> None:
    rc, out = _scan("tcp", prewarm=False)
    if rc != 0:
        pytest.skip(f"this UCX does not survive fd pressure even without the warm-up: {out}")
    rc, out = _scan("tcp", prewarm=True)
    assert rc == 0 and out.strip().endswith("clean"), (
        f"with aiokvcache.prewarm on, an engine started near RLIMIT_NOFILE left "
        f"the process changed (rc {rc}):\n{out}"
    )


# ---------------------------------------------------------------------------
# 3. The layering test does not hold _telemetry to "standard library only".
#
# docs/design.md and the commit say _telemetry is "standard library only (a
# test holds it to that)"; test_layout's comment says the leaves use "the
# standard library and the native module only". But
# test_the_leaves_import_only_the_native_module reads import_graph(), which
# keeps only aiokvcache's own modules: a leaf importing numpy,
# prometheus_client or opentelemetry passes it.
# ---------------------------------------------------------------------------


def test_the_leaf_check_rejects_a_third_party_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import test_layout

    pkg = tmp_path / "aiokvcache"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_loader.py").write_text("native = None\n")
    (pkg / "_ucxlog.py").write_text("from ._loader import native\n")
    # A leaf that pulls a third-party package in (and with it, its import
    # time and its failure modes, into every layer that uses the leaf).
    (pkg / "_telemetry.py").write_text("import logging\nimport prometheus_client\n")
    monkeypatch.setattr(test_layout, "PKG", pkg)
    assert "aiokvcache._telemetry" in test_layout.import_graph()
    with pytest.raises(AssertionError):
        test_layout.test_the_leaves_import_only_the_native_module()


# ---------------------------------------------------------------------------
# The polling schedules (_loopside.poll): the default backs off from 0.5 ms by
# doubling; FINE (a link's probes) asks for pauses from 50 us, growing by
# half. Both stop at 20 ms. This checks the schedule poll asks for (a fake
# sleep): on asyncio's selector loop a pause under 1 ms sleeps about 1 ms.
# ---------------------------------------------------------------------------


def _pauses(schedule: tuple[float, float] | None, polls: int) -> list[float]:
    import asyncio

    from aiokvcache._loopside import poll

    pauses: list[float] = []
    clock = [0.0]

    async def sleep(s: float) -> None:
        pauses.append(s)
        clock[0] += s

    left = iter(range(polls))

    def done() -> bool:
        return next(left, None) is None

    args = () if schedule is None else (schedule,)
    assert asyncio.run(poll(done, None, sleep, lambda: clock[0], *args))
    return pauses


def test_the_fine_poll_schedule_asks_for_pauses_growing_by_half() -> None:
    from aiokvcache._loopside import FINE

    fine = _pauses(FINE, 40)
    assert fine[0] == pytest.approx(50e-6)
    assert all(b <= a * 1.5 + 1e-12 for a, b in itertools.pairwise(fine))
    assert max(fine) == pytest.approx(0.02)
    # Each pause (what a wait can be overshot by) is at most the time already
    # waited past the first two, and tends to half of it.
    waited = 0.0
    for i, p in enumerate(fine):
        if i >= 2 and p < 0.02:
            assert p <= waited, (i, p, waited)
        waited += p
    default = _pauses(None, 10)
    assert default[:3] == pytest.approx([0.0005, 0.001, 0.002])
