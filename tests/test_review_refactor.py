"""Behaviour the structural refactor (option table, typed wire messages,
split service) must keep, found by a review of it.

The first two failed on the refactor as first written (the peer_timeout
setter's message lost its unit; generate_options emitted its keys in the
table's order instead of the order it always had). The third pins a
deliberate change: a peer's cache_by_addr answer is checked whole before
anything is installed, so a bad entry leaves no partial state.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from aiokvcache._core.config.options import LLMConfig
from aiokvcache._core.model.errors import LLMException, LLMStatusCode


def test_peer_timeout_setter_message_names_the_unit() -> None:
    """_core/option_table.py:294 (the generated int setter's ``gap`` check):
    before, ``LLMConfig.peer_timeout = 5`` raised
    ``ValueError("peer_timeout must be 0 or >= 100 ms, got 5")``; now the
    message lost " ms" ("... >= 100, got 5"). EngineOptions.from_options
    still says "ms" (option_table.py:352), so the two paths now disagree."""
    cfg = LLMConfig()
    with pytest.raises(ValueError) as info:
        cfg.peer_timeout = 5
    assert str(info.value) == "peer_timeout must be 0 or >= 100 ms, got 5"


def test_generate_options_key_order_is_kept() -> None:
    """_core/options.py LLMConfig.generate_options: before, the keys came
    out in a fixed order (ge_options, device ids, pass-through keys, then
    llm.RdmaTrafficClass, llm.RdmaServiceLevel, llm.listenIpInfo,
    llm.SyncKvCacheWaitTime, ... aiokvcache.transport ... directCopy ...);
    now the table's order puts aiokvcache.* before llm.listenIpInfo and the
    rdma keys last. Dict equality is unchanged, iteration order is not."""
    cfg = LLMConfig()
    cfg.ge_options = {"z": "1"}
    cfg.transport = "tcp"
    cfg.rdma_service_level = 3
    cfg.listen_ip_info = "1.2.3.4:5"
    cfg.sync_kv_timeout = 7
    cfg.direct_copy = False
    assert list(cfg.generate_options()) == [
        "z",
        "llm.RdmaServiceLevel",
        "llm.listenIpInfo",
        "llm.SyncKvCacheWaitTime",
        "aiokvcache.transport",
        "aiokvcache.directCopy",
    ]


def test_a_cache_by_addr_answer_with_a_bad_entry_installs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """_core/lookups.py Lookups.remotes_by_addr + _core/wire.py
    CacheMetas.decode: the whole answer is checked before any entry is
    installed (the entries used to be installed one by one, so those before a
    non-dict one stayed), and the error names the answer."""
    from aiokvcache._core.peers import lookups as lookups_mod

    installed: list[dict[str, Any]] = []
    monkeypatch.setattr(
        lookups_mod, "install_remote", lambda st, link, meta: installed.append(meta)
    )

    class Conn:
        async def request(self, op: str, body: dict[str, Any], timeout: Any = None) -> Any:
            assert op == "cache_by_addr"
            return {"caches": [{"cache_id": 1}, 5]}

    link = SimpleNamespace(ctl_rkey=1, cluster_id=7, conn=Conn())
    lk = lookups_mod.Lookups(SimpleNamespace(), SimpleNamespace(), SimpleNamespace())
    with pytest.raises(LLMException) as info:
        asyncio.run(lk.remotes_by_addr(link, [4096]))  # type: ignore[arg-type]
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert "cluster 7 sent a bad cache_by_addr answer" in info.value.message
    assert installed == []
