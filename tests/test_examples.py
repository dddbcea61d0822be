"""The examples run as a user would run them: two processes each, on one
machine (the parent starts the listening side as a child) and started by
hand as on two hosts; their ``--help``; their failures."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aiokvcache.testing import Child

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Each example: its listening role, its connecting role.
ROLES = {
    "push_flow.py": ("decoder", "prompt"),
    "pull_flow.py": ("prompt", "decoder"),
    "layerwise_pd.py": ("decode", "prefill"),
}
PROTOCOL = re.compile(r"^(READY|DIGEST) ", re.M)  # lines for a parent process only


def run(args: list[str], timeout: float = 90) -> str:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def words(text: str) -> str:
    return " ".join(text.split())


def parser_of(example: str) -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location(example.removesuffix(".py"), EXAMPLES / example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # As when it runs as a script: its directory first on sys.path (_cli.py).
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# ------------------------------------------------------------ one machine


def test_push_flow(transport: str) -> None:
    out = run([str(EXAMPLES / "push_flow.py"), "--transport", transport])
    assert "prompt: pushed 8 layers to CacheKey(cluster_id=2, req_id=42)" in out
    assert "push flow: 8 layers landed in the decoder's slot 1, sha256 matches" in out
    assert not PROTOCOL.search(out), out


def test_pull_flow(transport: str) -> None:
    out = run([str(EXAMPLES / "pull_flow.py"), "--transport", transport])
    assert out.count("… matches") == 4, out
    assert "pull flow: 4 requests pulled by CacheKey, sha256 of each matches" in out
    assert not PROTOCOL.search(out), out


def test_layerwise_pd(transport: str) -> None:
    out = run([str(EXAMPLES / "layerwise_pd.py"), "--transport", transport])
    assert "prefill: all 8 layers sent" in out
    assert "decode: all 8 layers verified" in out
    assert "layerwise: 8 layers sent as they were computed, all verified" in out
    assert not PROTOCOL.search(out), out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_structured_flow(backend: str, transport: str) -> None:
    """anyio on each backend: pushes in a task group, a cancel scope and a
    fail_after cutting pushes mid-way (nothing in flight, nothing written
    after), a pull back, finalize."""
    out = run(
        [str(EXAMPLES / "structured_flow.py"), "--backend", backend, "--transport", transport]
    )
    assert "16 layers pushed layer by layer" in out
    aborted = "aborted push: cut off True, in flight after it 0, destination still afterwards True"
    assert aborted in out
    assert (
        "bounded push: TimeoutError, in flight after it 0, destination still afterwards True"
        in out
        or "bounded push: landed in time" in out
    )
    assert "pulled back: identical" in out and out.rstrip().endswith("finalized")


# ------------------------------------------------------------ --help


@pytest.mark.parametrize("example", sorted(ROLES))
def test_help_is_complete(example: str) -> None:
    out = run([str(EXAMPLES / example), "--help"], timeout=30)
    parser = parser_of(example)
    text = words(out)
    description = parser.description or ""
    assert description.endswith("."), description
    assert words(description) in text
    listen, connect = ROLES[example]
    assert re.search(rf"^ +python examples/{example}$", out, re.M), out  # one machine
    assert f"python examples/{example} --role {listen} --listen" in out
    assert f"python examples/{example} --role {connect} --peer" in out
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = action.option_strings[0]
        assert action.help, f"{name} has no help"
        expanded = action.help % {**vars(action), "prog": parser.prog}
        assert words(expanded) in text, f"{name}: {expanded!r}"
        if action.default not in (None, False):
            assert f"(default: {action.default})" in expanded, name


# ------------------------------------------------------------ two hosts


def listening(child: Child, role: str) -> tuple[str, list[str]]:
    """The address the listening side printed and the command line it said to run."""
    line = child.read_line(f"{role} listening on ", timeout=30)
    m = re.fullmatch(rf"{role} listening on (\S+) — start the \w+ with: (.*)", line)
    assert m, line
    argv = shlex.split(m.group(2))
    assert argv[0] == "python", argv
    return m.group(1), [sys.executable, *argv[1:]]


def test_push_flow_on_two_hosts(transport: str) -> None:
    """The decoder, then the prompt as the decoder says: people's output, no cache id."""
    script = str(EXAMPLES / "push_flow.py")
    argv = [sys.executable, script, "--role", "decoder", "--transport", transport]
    with Child(argv, cwd=ROOT) as decoder:
        address, prompt_argv = listening(decoder, "decoder")
        assert prompt_argv[1:] == [
            script, "--role", "prompt", "--peer", address, "--transport", transport
        ]  # fmt: skip
        prompt = subprocess.run(prompt_argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert prompt.returncode == 0, prompt.stdout + prompt.stderr
        assert f"prompt: linked to cluster 2 at {address}" in prompt.stdout
        assert "prompt: pushed 8 layers to CacheKey(cluster_id=2, req_id=42)" in prompt.stdout
        out = decoder.read_rest(timeout=60)
        assert decoder.wait(30) == 0, out
    assert "decoder: 8 layers landed in batch slot 1, sha256 " in out
    assert out.rstrip().endswith("matches"), out
    assert not PROTOCOL.search(out + prompt.stdout)


def test_pull_flow_on_two_hosts() -> None:
    """The prompt serves until it is stopped; the decoder pulls and checks."""
    argv = [sys.executable, str(EXAMPLES / "pull_flow.py"), "--role", "prompt"]
    with Child(argv, cwd=ROOT) as prompt:
        _, decoder_argv = listening(prompt, "prompt")
        decoder = subprocess.run(decoder_argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert decoder.returncode == 0, decoder.stdout + decoder.stderr
        assert decoder.stdout.count("… matches") == 4, decoder.stdout
        prompt.proc.send_signal(signal.SIGTERM)
        out = prompt.read_rest(timeout=30)
        assert prompt.wait(30) == 0, out
    assert out.rstrip().endswith("prompt: stopped"), out


@pytest.mark.parametrize("example", sorted(ROLES))
def test_a_failure_is_one_line(example: str) -> None:
    _, connect = ROLES[example]
    peer = f"127.0.0.1:{closed_port()}"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--role", connect, "--peer", peer],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: LLM_LINK_FAILED: could not link to the "), last
    assert peer in last


@pytest.mark.parametrize("example", sorted(ROLES))
def test_a_bad_peer_is_a_usage_error(example: str) -> None:
    _, connect = ROLES[example]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--role", connect, "--peer", "localhost:1"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "--peer" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
