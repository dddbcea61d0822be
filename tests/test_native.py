"""The native module's own contract: status table, exceptions, release waits."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvcache._loader import native
from aiokvcache.errors import LLMStatusCode

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "tools" / "gen_native_stub.py"

# ------------------------------------------------------------ status table


def test_stub_matches_the_status_table() -> None:
    gen = subprocess.run(
        [sys.executable, str(GEN), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert gen.returncode == 0, gen.stdout + gen.stderr


def test_statuses_agree_with_the_constants() -> None:
    rows = native.STATUSES
    assert isinstance(rows, tuple) and rows
    names = [name for _, name, _, _ in rows]
    values = [value for value, _, _, _ in rows]
    assert len(set(names)) == len(names) and len(set(values)) == len(values)
    for value, name, words, llm_name in rows:
        assert getattr(native, f"ST_{name}") == value
        assert isinstance(words, str) and words
        assert llm_name in LLMStatusCode.__members__, llm_name
    exported = {a for a in dir(native) if a.startswith("ST_")}
    assert exported == {f"ST_{n}" for n in names}


def test_status_values_are_stable() -> None:
    # Completion tuples carry these numbers: renumbering breaks every reader.
    assert {name: value for value, name, _, _ in native.STATUSES} == {
        "OK": 0,
        "CANCELLED": 1,
        "TIMEOUT": 2,
        "LINK_FAILED": 3,
        "ENGINE_CLOSED": 4,
        "ERROR": 5,
        "INVALID": 6,
    }


def test_module_was_built_from_this_table() -> None:
    # Catches a stale extension: the stub and the module must describe one table.
    spec = importlib.util.spec_from_file_location("gen_native_stub", GEN)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    table = gen.parse((ROOT / "ext" / "status.def").read_text())
    assert [(r.value, r.name, r.words, r.llm_name) for r in table] == list(native.STATUSES)


# ------------------------------------------------------------ exceptions


def test_exception_hierarchy() -> None:
    # The bases keep every ``except RuntimeError`` / ``except ValueError``
    # written before these types existed working.
    assert issubclass(native.NativeError, RuntimeError)
    for exc in (native.EngineClosedError, native.InvalidArgumentError, native.UcxError):
        assert issubclass(exc, native.NativeError)
    assert issubclass(native.InvalidArgumentError, ValueError)
    assert not issubclass(native.UcxError, ValueError)
    assert not issubclass(native.EngineClosedError, ValueError)


@pytest.fixture
def engine() -> Iterator[Any]:
    eng = native.Engine("tcp")
    yield eng
    eng.close()


def test_unknown_ids_are_invalid_arguments(engine: Any) -> None:
    with pytest.raises(native.InvalidArgumentError, match="unknown region id"):
        engine.mem_release(12345)
    with pytest.raises(ValueError, match="unknown region id"):
        engine.rkey_pack(12345)
    with pytest.raises(native.InvalidArgumentError, match="unknown endpoint id"):
        engine.rkey_unpack(12345, b"key", 0, 1)


def test_bad_arguments_are_invalid_arguments(engine: Any) -> None:
    rows = np.zeros((1, 4), np.uint64)
    with pytest.raises(native.InvalidArgumentError, match="op must be"):
        engine.submit(7, 1, rows)
    with pytest.raises(native.InvalidArgumentError, match="shape"):
        engine.submit(native.OP_PUT, 1, np.zeros((1, 3), np.uint64))
    with pytest.raises(native.InvalidArgumentError, match="contiguous"):
        engine.submit(native.OP_PUT, 1, np.zeros((4, 8), np.uint64)[:, ::2])
    with pytest.raises(native.InvalidArgumentError, match="payload too large"):
        engine.submit(native.OP_PUT, 1, rows, b"x" * (native.MAX_PAYLOAD + 1))
    with pytest.raises(native.InvalidArgumentError, match="no payload"):
        engine.submit(native.OP_GET, 1, rows, b"x")
    with pytest.raises(native.InvalidArgumentError, match="address"):
        engine.mem_register(0, 4096)
    with pytest.raises(native.InvalidArgumentError, match="empty"):
        engine.connect(b"")
    with pytest.raises(native.InvalidArgumentError, match="empty"):
        engine.mem_register_buffer(bytearray())
    with pytest.raises(native.InvalidArgumentError, match="address"):
        native.buffer_from_address(0, 1)
    with pytest.raises(native.InvalidArgumentError, match="transport"):
        native.Engine("carrier-pigeon")
    with pytest.raises(native.InvalidArgumentError, match="max_inflight_bytes"):
        native.Engine("tcp", max_inflight_bytes=0)
    with pytest.raises(native.InvalidArgumentError, match="bad UCX option"):
        native.Engine("tcp", ucx_options={"NO_SUCH_OPTION": "1"})


def test_type_errors_stay_type_errors(engine: Any) -> None:
    with pytest.raises(TypeError) as ei:
        engine.submit(native.OP_PUT, 1, np.zeros((1, 4), np.int64))
    assert not isinstance(ei.value, native.NativeError)
    with pytest.raises(TypeError):
        engine.mem_release("1")


def test_ucx_failure_is_a_ucx_error(engine: Any) -> None:
    with pytest.raises(native.UcxError) as ei:
        engine.mem_alloc(1 << 60)
    assert isinstance(ei.value, RuntimeError) and not isinstance(ei.value, ValueError)
    assert ei.value.ucs_status < 0
    assert native.ucs_status_string(ei.value.ucs_status) in str(ei.value)
    assert str(ei.value).startswith("ucp_mem_map")


CALLS_AFTER_CLOSE: dict[str, Callable[[Any], object]] = {
    "info": lambda e: e.info(),
    "mem_alloc": lambda e: e.mem_alloc(4096),
    "mem_register": lambda e: e.mem_register(4096, 4096),
    "mem_register_buffer": lambda e: e.mem_register_buffer(bytearray(16)),
    "mem_release": lambda e: e.mem_release(1),
    "rkey_pack": lambda e: e.rkey_pack(1),
    "connect": lambda e: e.connect(b"address"),
    "disconnect": lambda e: e.disconnect(1),
    "fail_endpoint": lambda e: e.fail_endpoint(1),
    "rkey_unpack": lambda e: e.rkey_unpack(1, b"key", 0, 1),
    "rkey_release": lambda e: e.rkey_release(1),
    "submit": lambda e: e.submit(native.OP_PUT, 1, np.zeros((1, 4), np.uint64)),
}


@pytest.mark.parametrize("call", CALLS_AFTER_CLOSE.values(), ids=CALLS_AFTER_CLOSE.keys())
def test_calls_after_close_raise_engine_closed(call: Callable[[Any], object]) -> None:
    eng = native.Engine("tcp")
    eng.close()
    with pytest.raises(native.EngineClosedError, match="closed"):
        call(eng)
    # What stays usable on a closed engine.
    eng.cancel(1)
    eng.close()
    assert eng.closed and eng.drain() == [] and eng.stats()["live_jobs"] == 0
