"""The command line as a newcomer meets it: help, the bench's table and JSON,
its timeline plot, one-line errors, and no raw UCX lines."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--layers=4", "--tokens=256", "--iterations=2"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiokvcache", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def no_raw_noise(text: str) -> None:
    assert "Traceback" not in text
    assert "==SUPPRESS==" not in text
    assert not re.search(r"UCX\s+(WARN|ERROR)", text), text


@pytest.mark.parametrize("verb", [None, "bench", "info", "demo"])
def test_help_is_complete(verb: str | None) -> None:
    proc = cli(*([verb] if verb else []), "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    no_raw_noise(out + proc.stderr)
    assert "``" not in out and ":mod:" not in out  # no reST markup
    assert "_decode" not in out
    if verb is None:
        for name in ("bench", "info", "demo", "--debug", "examples:"):
            assert name in out
    if verb == "bench":
        # Every option is explained, and shows its default when it has one.
        options = re.findall(r"^  (--[a-z-]+)", out, flags=re.M)
        assert {"--layers", "--tokens", "--iterations", "--json", "--plot"} <= set(options)
        for opt in ("--layers", "--batch", "--tokens", "--heads", "--head-dim", "--iterations"):
            block = out[out.index(f"  {opt}") :].split("\n  --", 1)[0]
            assert "(default:" in block, block


def parse_table(out: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^  (\S.*?)\s{2,}(\S.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2).split()
    return rows


def test_bench_table_is_consistent(transport: str) -> None:
    proc = cli("bench", *SMALL, f"--transport={transport}", "--compute-ms=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    no_raw_noise(proc.stdout + proc.stderr)
    head, table = proc.stdout.split("\n\n", 1)
    assert f"transport {transport}" in head and "cores" in head and "2 rounds after 1 cold" in head
    rows = parse_table(table)
    assert rows["decode side bytes verified"] == ["yes"]
    t = float(rows["transfer alone, ms"][0])
    c = float(rows["compute spent, ms"][0])
    w = float(rows["pipelined wall, ms"][0])
    assert float(rows["compute + transfer, ms"][0]) == pytest.approx(t + c, abs=0.15)
    # The overlap line is what the other lines say it is, within the
    # table's rounding (0.05 ms either way on each figure).
    overlap = float(rows["overlap (transfer hidden)"][0])
    assert 0 <= overlap <= 100

    def share(t: float, c: float, w: float) -> float:
        return max(0.0, min(1.0, (t + c - w) / min(t, c))) * 100

    e = 0.05
    lo = share(t - e, c - e, w + e) if min(t, c) > e else 0.0
    hi = share(t + e, c + e, w - e)
    assert lo - 0.5 <= overlap <= hi + 0.5, (t, c, w, overlap)
    # median within its range, cold reported apart
    for name in ("transfer alone, ms", "pipelined wall, ms"):
        med, lo, hi, cold = map(float, rows[name])
        assert lo <= med <= hi and cold > 0


@pytest.mark.parametrize(("compute", "blocks"), [("busy", 0), ("sleep", 16)], ids=["busy", "paged"])
def test_bench_variants_verify_the_bytes(compute: str, blocks: int) -> None:
    proc = cli("bench", *SMALL, f"--compute={compute}", f"--blocks={blocks}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert parse_table(proc.stdout)["decode side bytes verified"] == ["yes"]
    assert ("paged" in proc.stdout) == bool(blocks)


def test_bench_without_compute_says_overlap_is_undefined() -> None:
    proc = cli("bench", *SMALL, "--transport=shm", "--compute-ms=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert parse_table(proc.stdout)["overlap (transfer hidden)"] == ["n/a", "(no", "compute)"]


def test_bench_json_has_every_sample() -> None:
    proc = cli("bench", *SMALL, "--transport=shm", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # nothing but the JSON on stdout
    assert data["verified"] is True
    assert data["conditions"]["transport"] == "shm" and data["conditions"]["rounds"] == 2
    assert len(data["rounds"]) == 3  # the cold one, then two
    for r in data["rounds"]:
        assert sorted(p["kind"] for p in r) == ["alone", "pipelined"]
        for p in r:
            assert len(p["push_latency_s"]) == 4 and p["wall_s"] > 0
    s = data["summary"]
    assert s["transfer_alone_s"][1] <= s["transfer_alone_s"][0] <= s["transfer_alone_s"][2]
    assert s["bytes_per_pass"] == 4 * 2 * 256 * 8 * 128 * 2
    t, c, w = s["transfer_alone_s"][0], s["compute_s"][0], s["pipelined_wall_s"][0]
    assert s["no_overlap_s"] == pytest.approx(t + c)
    assert s["overlap"] == pytest.approx(max(0.0, min(1.0, (t + c - w) / min(t, c))))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bench_metrics_break_every_push_down_and_write_a_scrape(
    transport: str, tmp_path: Path
) -> None:
    pytest.importorskip("prometheus_client")
    out = tmp_path / "scrape.txt"
    proc = cli(
        "bench", *SMALL, f"--transport={transport}", "--json", "--metrics", f"--metrics-out={out}"
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # still one JSON object
    row = data["metrics"]["push_cache"]
    calls = 3 * 2 * 4  # (cold + 2 rounds) x (alone, pipelined) x 4 layers
    assert (row["calls"], row["failed"]) == (calls, 0)
    assert row["bytes"] == calls * 2 * 256 * 8 * 128 * 2  # K and V of one layer each
    for phase in ("call", "submitted", "posted", "done", "seen"):
        assert row[phase]["n"] == calls and 0 <= row[phase]["p50_us"] <= row[phase]["p99_us"]
    scrape = out.read_text()
    for phase in ("submitted", "posted", "done", "seen"):
        line = f'aiokvcache_transfer_phase_seconds_count{{op="push_cache",phase="{phase}"}}'
        assert f"{line} {calls}.0" in scrape
    assert 'aiokvcache_transfer_bytes_total{op="push_cache",peer="2"}' in scrape
    table = cli("bench", *SMALL, f"--transport={transport}", "--metrics")
    assert table.returncode == 0, table.stderr
    assert "where a push's time went" in table.stdout and "push_cache" in table.stdout


def test_bench_plot_renders_a_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    proc = cli("bench", *SMALL, "--transport=shm", f"--plot={png}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert str(png) in proc.stdout


def test_unavailable_transport_is_one_clean_error() -> None:
    proc = cli("bench", "--transport=rdma", timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: LLM_FEATURE_NOT_ENABLED: "), proc.stderr
    assert lines[1].startswith("  hint: ") and len(lines) == 2, proc.stderr
    no_raw_noise(proc.stdout + proc.stderr)
    debug = cli("--debug", "bench", "--transport=rdma", timeout=60)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--layers=0", "--layers"),
        ("--blocks=7", "--blocks"),
        ("--dtype=nope", "--dtype"),
        ("--metrics-out=x.txt", "--metrics-out"),
    ],
)
def test_bench_rejects_bad_arguments(arg: str, flag: str) -> None:
    proc = cli("bench", arg, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and flag in proc.stderr
    assert "Traceback" not in proc.stderr


def test_info_and_demo_print_no_raw_ucx_lines() -> None:
    info = cli("info")
    assert info.returncode == 0 and "transport tcp" in info.stdout
    no_raw_noise(info.stdout + info.stderr)
    demo = cli("demo")
    assert demo.returncode == 0 and "pulled by CacheKey" in demo.stdout
    no_raw_noise(demo.stdout + demo.stderr)


def test_ucx_lines_reach_the_library_logger(caplog: pytest.LogCaptureFixture) -> None:
    """An engine UCX refuses (rdma without verbs, as on this machine) makes
    UCX warn; the warning arrives through ``aiokvcache.ucx``, not stderr."""
    from aiokvcache import _ucxlog
    from aiokvcache._loader import native

    caplog.set_level(logging.DEBUG, logger="aiokvcache.ucx")
    try:
        native.Engine("rdma").close()
    except native.NativeError:
        pass
    else:
        pytest.skip("this UCX has verbs: it does not warn about rdma")
    _ucxlog.drain()
    records = [r for r in caplog.records if r.name == "aiokvcache.ucx"]
    assert records, "UCX said nothing about the missing transport"
    assert any("not available" in r.getMessage() for r in records)
    assert not native.ucx_log_pending()


def test_ucx_leftover_objects_at_worker_destroy_are_debug_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """"object ... was not returned to mpool" (a forced close leaves them by
    design) is a DEBUG line of ``aiokvcache.ucx``; other warnings stay warnings."""
    from aiokvcache import _ucxlog
    from aiokvcache._loader import native

    caplog.set_level(logging.DEBUG, logger="aiokvcache.ucx")
    _ucxlog.drain()
    caplog.clear()
    native.ucx_log_emit(2, "object 0x55 was not returned to mpool ucp_rkeys")
    native.ucx_log_emit(2, "some other warning")
    _ucxlog.drain()
    levels = {r.getMessage().split(" (")[0]: r.levelno for r in caplog.records}
    assert levels == {
        "UCX: object 0x55 was not returned to mpool ucp_rkeys": logging.DEBUG,
        "UCX: some other warning": logging.WARNING,
    }, levels
