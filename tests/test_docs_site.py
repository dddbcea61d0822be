"""The documentation site (mkdocs.yml, docs/) keeps up with the code.

* Every ``LLMStatusCode`` member, aliases included, is documented in
  docs/troubleshooting.md: as a heading of its own or in the first cell of a
  table row.
* Every ``aiokvcache.*`` option key of ``aiokvcache._core.config.options`` is in
  docs/tuning.md.
* docs/reference.md has a mkdocstrings entry for every public name.
* ``mkdocs build --strict`` succeeds (skipped without the ``docs`` extra).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiokvcache
from aiokvcache._core.config import options

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```.*?^```\s*$", re.M | re.S)


def prose(page: str) -> str:
    """A page's text without its fenced code blocks."""
    return FENCE.sub("", (DOCS / page).read_text())


def documented_codes(text: str) -> set[str]:
    """Names given a heading (``### LLM_X``) or named in a table row's first cell."""
    names = set(re.findall(r"^#{2,6}\s+`?(LLM_\w+)`?\s*$", text, re.M))
    for row in re.findall(r"^\|([^|\n]*)\|", text, re.M):
        names.update(re.findall(r"`(LLM_\w+)`", row))
    return names


def test_every_status_code_is_in_troubleshooting() -> None:
    members = set(aiokvcache.LLMStatusCode.__members__)
    assert "LLM_SEQ_LEN_OVER_LIMIT" in members  # aliases are members too
    missing = sorted(members - documented_codes(prose("troubleshooting.md")))
    assert not missing, f"docs/troubleshooting.md does not document: {', '.join(missing)}"


def test_documented_codes_exist() -> None:
    unknown = documented_codes(prose("troubleshooting.md")) - set(
        aiokvcache.LLMStatusCode.__members__
    )
    assert not unknown, f"docs/troubleshooting.md documents unknown codes: {sorted(unknown)}"


def aiokvcache_keys() -> dict[str, str]:
    return {
        name: value
        for name, value in vars(options).items()
        if name.startswith("KEY_") and isinstance(value, str) and value.startswith("aiokvcache.")
    }


def test_every_aiokvcache_option_key_is_in_tuning() -> None:
    keys = aiokvcache_keys()
    assert len(keys) >= 10, keys  # the constants are still found where the test looks
    text = prose("tuning.md")
    missing = sorted(f"{name} = {key!r}" for name, key in keys.items() if f"`{key}`" not in text)
    assert not missing, f"docs/tuning.md does not name: {', '.join(missing)}"


def public_objects() -> list[str]:
    """Names of ``aiokvcache.__all__`` that are objects' own names (not aliases, not dunders)."""
    return [
        name
        for name in aiokvcache.__all__
        if not name.startswith("_") and getattr(getattr(aiokvcache, name), "__name__", "") == name
    ]


def test_reference_has_every_public_name() -> None:
    entries = set(
        re.findall(r"^::: aiokvcache\.(\w+)\s*$", (DOCS / "reference.md").read_text(), re.M)
    )
    missing = sorted(set(public_objects()) - entries)
    assert not missing, f"docs/reference.md has no entry for: {', '.join(missing)}"


def test_design_names_only_peer_service_calls_that_exist() -> None:
    """design.md says how the owner reaches the peer-service thread. Since
    PeerService forwards nothing (the runtime calls the part that does the
    work: ``service.thread.call``, ``service.linker.link_all`` ...), a
    ``service.<name>(`` in its prose must still be a PeerService attribute."""
    from aiokvcache._core.peers.service import PeerService

    named = set(re.findall(r"`service\.(\w+)\(", prose("design.md")))
    stale = sorted(name for name in named if not hasattr(PeerService, name))
    assert not stale, f"docs/design.md names PeerService calls that do not exist: {stale}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f'{module} is missing: pip install ".[docs]"')
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    reference = (site / "reference" / "index.html").read_text()
    for name in public_objects():
        assert f'id="aiokvcache.{name}"' in reference, f"no generated entry for {name}"
    # The hook strips reST roles: no ":class:" left in front of a code span.
    assert not re.search(r":(class|meth|attr|func|mod):<code>", reference)
