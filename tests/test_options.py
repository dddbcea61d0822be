"""Tests for aiokvcache.options (plain sync tests)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from aiokvcache.errors import LLMException, LLMStatusCode
from aiokvcache.options import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    KEY_AUTH_TOKEN,
    KEY_ENABLE_CACHE_MANAGER,
    KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    KEY_HOST_MEM_POOL_CONFIG,
    KEY_LINK_RETRY_COUNT,
    KEY_LINK_TOTAL_TIME,
    KEY_LISTEN_IP_INFO,
    KEY_MAX_INFLIGHT_BYTES,
    KEY_MEM_POOL_CONFIG,
    KEY_SYNC_KV_TIMEOUT,
    KEY_TRANSPORT,
    EngineOptions,
    LLMConfig,
)

MIB = 1024 * 1024


def test_key_names() -> None:
    # LLM-DataDist's exact spellings.
    assert KEY_LISTEN_IP_INFO == "llm.listenIpInfo"
    assert KEY_SYNC_KV_TIMEOUT == "llm.SyncKvCacheWaitTime"
    assert KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE == "llm.EnableRemoteCacheAccessible"
    assert KEY_ENABLE_CACHE_MANAGER == "llm.EnableCacheManager"
    assert KEY_MEM_POOL_CONFIG == "llm.MemPoolConfig"
    assert KEY_HOST_MEM_POOL_CONFIG == "llm.HostMemPoolConfig"
    assert KEY_LINK_TOTAL_TIME == "llm.LinkTotalTime"
    assert KEY_LINK_RETRY_COUNT == "llm.LinkRetryCount"
    assert KEY_TRANSPORT == "aiokvcache.transport"
    assert KEY_AUTH_TOKEN == "aiokvcache.authToken"
    assert KEY_MAX_INFLIGHT_BYTES == "aiokvcache.maxInflightBytes"


# ---------------------------------------------------------------- LLMConfig


def test_llm_config_empty() -> None:
    cfg = LLMConfig()
    assert cfg.generate_options() == {}
    assert cfg.listen_ip_info == ""
    assert cfg.sync_kv_timeout == 1000
    assert cfg.enable_remote_cache_accessible is True
    assert cfg.enable_cache_manager is True
    assert cfg.mem_pool_cfg == "" and cfg.host_mem_pool_cfg == ""
    assert cfg.link_total_time == 0 and cfg.link_retry_count == 1
    assert cfg.transport == "auto"
    assert cfg.auth_token is None
    assert cfg.max_inflight_bytes == DEFAULT_MAX_INFLIGHT_BYTES == 64 * MIB
    assert cfg.device_id is None and cfg.ge_options == {}


def test_llm_config_all_set() -> None:
    cfg = LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.sync_kv_timeout = 2500
    cfg.enable_remote_cache_accessible = False
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 1073741824}'
    cfg.host_mem_pool_cfg = '{"memory_size": 4096, "page_shift": 16}'
    cfg.link_total_time = 20
    cfg.link_retry_count = 3
    cfg.transport = "shm"
    cfg.auth_token = "s3cret"
    cfg.max_inflight_bytes = 8 * MIB
    assert cfg.generate_options() == {
        "llm.listenIpInfo": "127.0.0.1:0",
        "llm.SyncKvCacheWaitTime": "2500",
        "llm.EnableRemoteCacheAccessible": "0",
        "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": '{"memory_size": 1073741824}',
        "llm.HostMemPoolConfig": '{"memory_size": 4096, "page_shift": 16}',
        "llm.LinkTotalTime": "20",
        "llm.LinkRetryCount": "3",
        "aiokvcache.transport": "shm",
        "aiokvcache.authToken": "s3cret",
        "aiokvcache.maxInflightBytes": str(8 * MIB),
    }
    assert cfg.sync_kv_timeout == 2500
    assert cfg.enable_remote_cache_accessible is False
    assert cfg.link_total_time == 20 and cfg.link_retry_count == 3
    # Round trip through EngineOptions.
    eo = EngineOptions.from_options(cfg.generate_options())
    assert (eo.listen_host, eo.listen_port) == ("127.0.0.1", 0)
    assert eo.sync_kv_timeout_ms == 2500
    assert eo.enable_remote_cache_accessible is False
    assert eo.mem_pool_bytes == 1073741824 and eo.host_mem_pool_bytes == 4096
    assert (eo.link_total_time_s, eo.link_retry_count) == (20, 3)
    assert eo.transport == "shm" and eo.auth_token == b"s3cret"
    assert eo.max_inflight_bytes == 8 * MIB
    assert eo.unknown_keys == ()


def test_llm_config_bool_formats() -> None:
    cfg = LLMConfig()
    cfg.enable_remote_cache_accessible = True
    cfg.enable_cache_manager = False
    opts = cfg.generate_options()
    assert opts["llm.EnableRemoteCacheAccessible"] == "1"
    assert opts["llm.EnableCacheManager"] == "0"
    assert cfg.enable_cache_manager is False


def test_llm_config_only_set_keys_and_fresh_dict() -> None:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = "300"
    first = cfg.generate_options()
    assert first == {"llm.SyncKvCacheWaitTime": "300"}
    first["junk"] = "x"
    assert cfg.generate_options() == {"llm.SyncKvCacheWaitTime": "300"}
    assert cfg.sync_kv_timeout == 300


def test_llm_config_accepted_values() -> None:
    cfg = LLMConfig()
    for addr in ("0.0.0.0:26000", "localhost:1", "node-1.example.com:65535", "[::1]:0"):
        cfg.listen_ip_info = addr
        assert cfg.listen_ip_info == addr
    cfg.sync_kv_timeout = 1
    cfg.sync_kv_timeout = 2**31 - 1
    cfg.sync_kv_timeout = "2147483647"
    cfg.link_total_time = 0
    cfg.link_total_time = 2**32 - 1
    cfg.link_retry_count = 1
    cfg.link_retry_count = 100
    for name in ("auto", "shm", "tcp", "rdma"):
        cfg.transport = name
        assert cfg.transport == name
    cfg.auth_token = b"bytes-token"
    assert cfg.auth_token == "bytes-token"
    cfg.max_inflight_bytes = 1
    cfg.max_inflight_bytes = 2**63 - 1
    cfg.mem_pool_cfg = '{"memory_size": 1, "page_shift": 10, "other": 1}'
    cfg.mem_pool_cfg = '{"memory_size": 1, "page_shift": 30}'


@pytest.mark.parametrize(
    ("prop", "value"),
    [
        ("listen_ip_info", 26000),
        ("listen_ip_info", b"1.2.3.4:5"),
        ("sync_kv_timeout", 1.5),
        ("sync_kv_timeout", True),
        ("sync_kv_timeout", None),
        ("enable_remote_cache_accessible", 1),
        ("enable_remote_cache_accessible", "1"),
        ("enable_cache_manager", 0),
        ("mem_pool_cfg", {"memory_size": 1}),
        ("host_mem_pool_cfg", 1024),
        ("link_total_time", "20"),
        ("link_total_time", 1.0),
        ("link_retry_count", True),
        ("transport", 1),
        ("auth_token", 123),
        ("auth_token", None),
        ("max_inflight_bytes", "1"),
        ("device_id", "0"),
        ("device_id", [0, "1"]),
        ("ge_options", [("a", "b")]),
        ("ge_options", {"a": 1}),
        ("ge_options", {1: "a"}),
    ],
)
def test_llm_config_type_errors(prop: str, value: Any) -> None:
    cfg = LLMConfig()
    with pytest.raises(TypeError, match=prop):
        setattr(cfg, prop, value)
    assert cfg.generate_options() == {}


@pytest.mark.parametrize(
    ("prop", "value"),
    [
        ("listen_ip_info", ""),
        ("listen_ip_info", "1.2.3.4"),
        ("listen_ip_info", ":26000"),
        ("listen_ip_info", "1.2.3.4:"),
        ("listen_ip_info", "1.2.3.4:65536"),
        ("listen_ip_info", "1.2.3.4:-1"),
        ("listen_ip_info", "1.2.3.4:port"),
        ("listen_ip_info", "1.2.3.4:26000;1.2.3.5:26000"),
        ("listen_ip_info", "300.1.1.1:1"),
        ("listen_ip_info", "1.2.3:1"),
        ("listen_ip_info", "bad_host:1"),
        ("listen_ip_info", "::1:80"),
        ("listen_ip_info", "[zz::1]:80"),
        ("sync_kv_timeout", 0),
        ("sync_kv_timeout", -5),
        ("sync_kv_timeout", 2**31),
        ("sync_kv_timeout", "0"),
        ("sync_kv_timeout", "abc"),
        ("sync_kv_timeout", "-1"),
        ("sync_kv_timeout", "1.5"),
        ("sync_kv_timeout", ""),
        ("mem_pool_cfg", ""),
        ("mem_pool_cfg", "not json"),
        ("mem_pool_cfg", "[1]"),
        ("mem_pool_cfg", "{}"),
        ("mem_pool_cfg", '{"memory_size": 0}'),
        ("mem_pool_cfg", '{"memory_size": -1}'),
        ("mem_pool_cfg", '{"memory_size": "1"}'),
        ("mem_pool_cfg", '{"memory_size": true}'),
        ("mem_pool_cfg", '{"memory_size": 1.5}'),
        ("mem_pool_cfg", '{"memory_size": 1, "page_shift": 9}'),
        ("mem_pool_cfg", '{"memory_size": 1, "page_shift": 31}'),
        ("host_mem_pool_cfg", '{"memory_size": 0}'),
        ("link_total_time", -1),
        ("link_total_time", 2**32),
        ("link_retry_count", 0),
        ("link_retry_count", 101),
        ("transport", "udp"),
        ("transport", "SHM"),
        ("transport", ""),
        ("auth_token", ""),
        ("auth_token", b""),
        ("auth_token", b"\xff\xfe"),
        ("max_inflight_bytes", 0),
        ("max_inflight_bytes", 2**63),
        ("device_id", -1),
        ("device_id", []),
        ("device_id", [0, -1]),
    ],
)
def test_llm_config_value_errors(prop: str, value: Any) -> None:
    cfg = LLMConfig()
    with pytest.raises(ValueError, match=prop):
        setattr(cfg, prop, value)
    assert cfg.generate_options() == {}


def test_llm_config_porting_extras() -> None:
    cfg = LLMConfig()
    cfg.device_id = 3
    cfg.ge_options = {"ge.some": "x", "llm.SyncKvCacheWaitTime": "7"}
    cfg.sync_kv_timeout = 9
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "3" and opts["ge.session_device_id"] == "3"
    assert opts["ge.some"] == "x"
    assert opts["llm.SyncKvCacheWaitTime"] == "9"  # the property wins
    cfg.device_id = [1, 2]
    assert cfg.device_id == (1, 2)
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "1;2" and opts["ge.session_device_id"] == "1"
    eo = EngineOptions.from_options(opts)
    assert eo.unknown_keys == ("ge.some",)
    # LLM-DataDist's keys are known: accepted, listed at init as without effect.
    assert set(eo.no_effect_keys) == {"ge.exec.deviceId", "ge.session_device_id"}
    assert eo.sync_kv_timeout_ms == 9


def test_peer_timeout_setter_message_names_the_unit() -> None:
    """The setter and EngineOptions.from_options must say the same: without
    " ms" the setter's message read as if 100 were seconds."""
    cfg = LLMConfig()
    with pytest.raises(ValueError) as info:
        cfg.peer_timeout = 5
    assert str(info.value) == "peer_timeout must be 0 or >= 100 ms, got 5"


def test_generate_options_keeps_its_key_order() -> None:
    """Dict equality hides it, iteration shows it: built from the option table,
    the keys came out in the table's order instead of the order they always had."""
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


# ---------------------------------------------------------------- EngineOptions


def test_engine_options_defaults() -> None:
    for eo in (EngineOptions.from_options(None), EngineOptions.from_options({}), EngineOptions()):
        assert eo.listen_host is None and eo.listen_port is None
        assert eo.listen_address is None
        assert eo.sync_kv_timeout_ms == 1000
        assert eo.enable_remote_cache_accessible is True
        assert eo.mem_pool_bytes is None and eo.host_mem_pool_bytes is None
        assert eo.link_total_time_s == 0 and eo.link_retry_count == 1
        assert eo.transport == "auto"
        assert eo.auth_token is None
        assert eo.max_inflight_bytes == 64 * MIB
        assert eo.unknown_keys == ()


def test_engine_options_frozen_and_secret_repr() -> None:
    eo = EngineOptions.from_options({"aiokvcache.authToken": "hunter2"})
    assert eo.auth_token == b"hunter2"
    assert "hunter2" not in repr(eo)
    with pytest.raises(dataclasses.FrozenInstanceError):
        eo.transport = "tcp"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "host", "port", "address"),
    [
        ("127.0.0.1:0", "127.0.0.1", 0, "127.0.0.1:0"),
        ("0.0.0.0:26000", "0.0.0.0", 26000, "0.0.0.0:26000"),
        ("localhost:65535", "localhost", 65535, "localhost:65535"),
        ("[::1]:80", "::1", 80, "[::1]:80"),
    ],
)
def test_engine_options_listen(text: str, host: str, port: int, address: str) -> None:
    eo = EngineOptions.from_options({"llm.listenIpInfo": text})
    assert (eo.listen_host, eo.listen_port, eo.listen_address) == (host, port, address)


def test_engine_options_unknown_keys_kept() -> None:
    opts = {
        "llm.Role": "Prompt",
        "llm.MemoryUtilization": "0.95",
        "llm.SyncKvCacheWaitTime": "5",
        "llm.LocalCommRes": "{}",
    }
    eo = EngineOptions.from_options({**opts, "llm.Typo": "1"})
    assert eo.no_effect_keys == ("llm.Role", "llm.MemoryUtilization", "llm.LocalCommRes")
    assert eo.unknown_keys == ("llm.Typo",)
    assert eo.sync_kv_timeout_ms == 5


@pytest.mark.parametrize(
    ("key", "text", "field", "value"),
    [
        ("llm.SyncKvCacheWaitTime", "1", "sync_kv_timeout_ms", 1),
        ("llm.SyncKvCacheWaitTime", "2147483647", "sync_kv_timeout_ms", 2**31 - 1),
        ("llm.EnableRemoteCacheAccessible", "1", "enable_remote_cache_accessible", True),
        ("llm.EnableRemoteCacheAccessible", "0", "enable_remote_cache_accessible", False),
        ("llm.MemPoolConfig", '{"memory_size": 2048}', "mem_pool_bytes", 2048),
        (
            "llm.HostMemPoolConfig",
            '{"memory_size": 1073741824, "page_shift": 16}',
            "host_mem_pool_bytes",
            1073741824,
        ),
        ("llm.LinkTotalTime", "0", "link_total_time_s", 0),
        ("llm.LinkTotalTime", "4294967295", "link_total_time_s", 2**32 - 1),
        ("llm.LinkRetryCount", "1", "link_retry_count", 1),
        ("llm.LinkRetryCount", "100", "link_retry_count", 100),
        ("aiokvcache.transport", "auto", "transport", "auto"),
        ("aiokvcache.transport", "tcp", "transport", "tcp"),
        ("aiokvcache.transport", "rdma", "transport", "rdma"),
        ("aiokvcache.authToken", "tök", "auth_token", "tök".encode()),
        ("aiokvcache.maxInflightBytes", "1", "max_inflight_bytes", 1),
        ("aiokvcache.maxInflightBytes", str(2**63 - 1), "max_inflight_bytes", 2**63 - 1),
    ],
)
def test_engine_options_accepts(key: str, text: str, field: str, value: Any) -> None:
    eo = EngineOptions.from_options({key: text})
    assert getattr(eo, field) == value


@pytest.mark.parametrize("text", ["0", "1"])
def test_engine_options_cache_manager_flag_accepted(text: str) -> None:
    eo = EngineOptions.from_options({"llm.EnableCacheManager": text})
    assert eo.unknown_keys == ()


@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("llm.listenIpInfo", ""),
        ("llm.listenIpInfo", "1.2.3.4"),
        ("llm.listenIpInfo", "1.2.3.4:70000"),
        ("llm.listenIpInfo", "1.2.3.4:1;1.2.3.5:1"),
        ("llm.listenIpInfo", "999.0.0.1:1"),
        ("llm.listenIpInfo", "host name:1"),
        ("llm.SyncKvCacheWaitTime", "0"),
        ("llm.SyncKvCacheWaitTime", "2147483648"),
        ("llm.SyncKvCacheWaitTime", "ten"),
        ("llm.SyncKvCacheWaitTime", " 10"),
        ("llm.SyncKvCacheWaitTime", "+10"),
        ("llm.EnableRemoteCacheAccessible", "true"),
        ("llm.EnableRemoteCacheAccessible", ""),
        ("llm.EnableRemoteCacheAccessible", "2"),
        ("llm.EnableCacheManager", "yes"),
        ("llm.MemPoolConfig", ""),
        ("llm.MemPoolConfig", "{"),
        ("llm.MemPoolConfig", '{"size": 1}'),
        ("llm.MemPoolConfig", '{"memory_size": 0}'),
        ("llm.HostMemPoolConfig", '{"memory_size": 1, "page_shift": 40}'),
        ("llm.LinkTotalTime", "-1"),
        ("llm.LinkTotalTime", "4294967296"),
        ("llm.LinkRetryCount", "0"),
        ("llm.LinkRetryCount", "101"),
        ("aiokvcache.transport", "ucx"),
        ("aiokvcache.authToken", ""),
        ("aiokvcache.maxInflightBytes", "0"),
        ("aiokvcache.maxInflightBytes", "64MiB"),
        ("aiokvcache.maxInflightBytes", str(2**63)),
    ],
)
def test_engine_options_rejects(key: str, text: str) -> None:
    with pytest.raises(LLMException) as ei:
        EngineOptions.from_options({key: text})
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert key in str(ei.value)


@pytest.mark.parametrize(
    "options",
    [
        [("llm.SyncKvCacheWaitTime", "1")],
        "llm.SyncKvCacheWaitTime=1",
        {1: "1"},
        {"llm.SyncKvCacheWaitTime": 1000},
        {"llm.EnableRemoteCacheAccessible": True},
        {"unknown.key": None},
    ],
)
def test_engine_options_type_errors(options: Any) -> None:
    with pytest.raises(TypeError):
        EngineOptions.from_options(options)


def test_net_devices_option() -> None:
    from aiokvcache.options import KEY_NET_DEVICES, EngineOptions, LLMConfig

    cfg = LLMConfig()
    assert cfg.net_devices == "all"
    cfg.net_devices = "eth1,eth2"
    assert cfg.generate_options()[KEY_NET_DEVICES] == "eth1,eth2"
    assert EngineOptions.from_options({KEY_NET_DEVICES: "lo"}).net_devices == "lo"
    with pytest.raises(ValueError, match="net_devices"):
        cfg.net_devices = "eth 1"
    with pytest.raises(TypeError, match="net_devices"):
        cfg.net_devices = 3  # type: ignore[assignment]
    with pytest.raises(LLMException, match=KEY_NET_DEVICES):
        EngineOptions.from_options({KEY_NET_DEVICES: "a;b"})


# ---------------------------------------------------------------- the option table


def test_every_option_of_the_table_is_an_llmconfig_property_built_from_it() -> None:
    from aiokvcache._core.config.table import OPTIONS

    for opt in OPTIONS:
        prop = LLMConfig.__dict__.get(opt.prop)
        assert isinstance(prop, property), opt.prop
        assert prop.fget is not None and prop.fget.__qualname__.startswith("_option_property")
        assert prop.__doc__ is not None and prop.__doc__.endswith(f"Key ``{opt.key}``.")
        cfg = LLMConfig()
        assert getattr(cfg, opt.prop) == opt.unset
    assert len({opt.key for opt in OPTIONS}) == len({opt.prop for opt in OPTIONS}) == len(OPTIONS)


def test_every_engine_options_field_comes_from_one_option_with_its_default() -> None:
    from aiokvcache._core.config.table import OPTIONS

    owners: dict[str, str] = {}
    for opt in OPTIONS:
        for name in opt.fields:
            assert name not in owners, f"{name} is set by {owners[name]} and {opt.key}"
            owners[name] = opt.key
    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    assert set(fields) - set(owners) == {"unknown_keys", "no_effect_keys"}
    for opt in OPTIONS:
        if len(opt.fields) == 1:
            assert fields[opt.fields[0]].default == opt.default, opt.key


def test_tuning_tables_are_generated_from_the_option_table() -> None:
    from pathlib import Path

    from aiokvcache._core.config.docs import regenerate

    path = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"
    text = path.read_text(encoding="utf-8")
    assert text.count("<!-- generated: ") == 2
    assert regenerate(text) == text, (
        "docs/tuning.md's tables differ from the option table: run "
        "python -m aiokvcache._core.config.docs docs/tuning.md"
    )
