"""aiokvcache's pytest plugin as its users meet it.

* In a fresh virtual environment: the wheel built from this tree, installed
  with the ``pytest`` extra and nothing else, runs the example test file of
  ``docs/testing.md`` (the very blocks of that page) on asyncio and trio.
* In this one (pytest's ``pytester``): what its fixtures promise at
  teardown fails a test that breaks it (a native job left live, a peer
  process that died without being killed through it), and
  ``--kv-transports`` runs a test once per transport.
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "testing.md"
TITLED = re.compile(r'^```python title="([\w.]+)"\n(.*?)^```\s*$', re.M | re.S)

pytest_plugins = ["pytester"]


def page_files() -> dict[str, str]:
    """The files the testing page shows, by name (``title="..."`` blocks)."""
    return {m.group(1): m.group(2) for m in TITLED.finditer(PAGE.read_text())}


def test_the_page_shows_a_conftest_and_a_test_file() -> None:
    files = page_files()
    assert "conftest.py" in files and "test_handoff.py" in files, sorted(files)


def _run(argv: list[str], cwd: Path, timeout: float) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_example_in_a_fresh_venv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        ROOT,
        600,
    )
    (wheel,) = wheels.glob("aiokvcache-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", f"{wheel}[pytest]"], tmp_path, 600)
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in page_files().items():
        (suite / name).write_text(text)
    out = _run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kv-transports=shm,tcp"],
        suite,
        300,
    )
    counts = re.search(r"(\d+) passed", out)
    assert counts is not None and "failed" not in out and "error" not in out, out
    assert "skipped" not in out, out
    # Each test on two transports, and on two backends unless its file
    # chooses its own (the MockClock one: trio only).
    runs = 0
    for name, text in page_files().items():
        if name.startswith("test_"):
            backends = 1 if "def anyio_backend" in text else 2
            runs += 2 * backends * len(re.findall(r"^async def test_", text, re.M))
    assert int(counts.group(1)) == runs, out


# ------------------------------------------------------------ teardown promises

CONFTEST = """
import pytest

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param
"""


def _suite(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user="import pytest\npytestmark = pytest.mark.anyio\n" + body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=240)


def test_a_peer_that_died_fails_the_test(pytester: pytest.Pytester) -> None:
    result = _suite(
        pytester,
        """
import os, signal
import anyio

async def test_peer_dies(kv_peer):
    os.kill(kv_peer.pid, signal.SIGKILL)  # not through kv_peer.kill()
    await anyio.sleep(0.2)

async def test_peer_killed_on_purpose(kv_peer):
    await kv_peer.kill()
""",
    )
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(["*the peer process died during the test*"])


def test_a_transfer_left_in_flight_fails_the_test(pytester: pytest.Pytester) -> None:
    result = _suite(
        pytester,
        """
import asyncio
import pytest
import aiokvcache as kv

DESC = kv.CacheDesc(2, [1, 64 << 20], kv.DataType.DT_UINT8, kv.Placement.HOST)
KEEP = []

@pytest.fixture
def kv_options():
    return {"max_inflight_bytes": 64 * 1024, "direct_copy": False}

@pytest.fixture
def anyio_backend():
    return "asyncio"

async def test_leaves_a_push_behind(kv_pair):
    src, dst = kv_pair.p.allocate_cache(DESC), kv_pair.d.allocate_cache(DESC)
    key = kv.CacheKeyByIdAndIndex(2, dst.cache_id)
    # Started, never awaited: still moving when the test returns (once its
    # look-up is done and its jobs are submitted).
    KEEP.append(asyncio.ensure_future(kv_pair.p.push_cache(key, src, tensor_num_per_layer=1)))
    for _ in range(2000):
        if kv_pair.p.stats()["live_jobs"]:
            break
        await asyncio.sleep(0.001)
""",
    )
    result.assert_outcomes(errors=1, passed=1)
    result.stdout.fnmatch_lines(["*native jobs still live*"])


def test_kv_transports_runs_a_test_per_transport(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_user="""
import pytest
pytestmark = pytest.mark.anyio
SEEN = []

async def test_transport(kv_pair, kv_transport):
    SEEN.append(kv_transport)
    assert kv_pair.prompt.options.transport == kv_transport
"""
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-v", "--kv-transports=shm,tcp", timeout=240
    )
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_transport*asyncio-kv-shm*", "*test_transport*trio-kv-tcp*"])


AUTO_MODE_SUITE = """
import pytest
pytestmark = pytest.mark.anyio

async def test_uses_the_pair(kv_pair):
    pass

def test_plain():
    pass
"""


@pytest.mark.parametrize("how", ["ini", "option"])
def test_pytest_asyncio_auto_mode_is_one_clear_usage_error(
    pytester: pytest.Pytester, how: str
) -> None:
    """Auto mode would break every test that uses the fixtures, asyncio ones
    included: the run stops at collection and says what to set."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user=AUTO_MODE_SUITE)
    args = ["-p", "no:cacheprovider", "-q"]
    if how == "ini":
        pytester.makeini("[pytest]\nasyncio_mode = auto\n")
    else:
        args.append("--asyncio-mode=auto")
    result = pytester.runpytest_subprocess(*args, timeout=240)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines(["*auto mode*test_uses_the_pair*asyncio_mode = strict*"])


def test_pytest_asyncio_auto_mode_without_the_fixtures_is_left_alone(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_user="async def test_coroutine():\n    pass\n")
    pytester.makeini("[pytest]\nasyncio_mode = auto\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=240)
    result.assert_outcomes(passed=1)


def test_pytest_asyncio_strict_mode_runs_the_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user=AUTO_MODE_SUITE)
    pytester.makeini("[pytest]\nasyncio_mode = strict\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=240)
    result.assert_outcomes(passed=3)
