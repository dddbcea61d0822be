"""The native module's own contract: status table, exceptions, release waits."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

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
