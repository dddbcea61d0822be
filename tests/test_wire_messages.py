"""The peer messages' field specs: one encoder and one decoder for every
request and answer (``_core/wire/messages.py``, ``_core/wire/fields.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from aiokvcache._core.model.errors import LLMException, LLMStatusCode
from aiokvcache._core.model.types import BlocksCacheKey, CacheKey
from aiokvcache._core.wire import messages as wire

NONCE = b"n" * wire.PROBE_NONCE_BYTES

SAMPLES: list[wire.Message] = [
    wire.Served(),
    wire.ProbeSlot(addr=4096 + 64, length=wire.PROBE_BYTES, base=4096, span=1 << 20, rkey=b"k"),
    wire.ProbeResult(""),
    wire.ProbeResult("no route", NONCE, 3),
    wire.CacheMeta({"cache_id": 1, "anything": [1, 2]}),
    wire.KeyedCacheMeta({"cache_id": 1, "batch_index": 2}, 2),
    wire.CacheMetas(({"cache_id": 1}, {"cache_id": 2})),
    wire.Finalizing(),
    wire.Unlink(),
    wire.Alive(),
    wire.ProbeInfo(),
    wire.ProbeBack(0.5),
    wire.ProbeBack(0.5, NONCE, 7),
    wire.Invalidate(9),
    wire.CacheById(9),
    wire.CacheByKey(CacheKey(cluster_id=1, req_id=2, model_id=3, prefix_id=4)),
    wire.BlocksByKey(BlocksCacheKey(1, 2)),
    wire.CacheByAddr((1, 2, 3)),
    wire.Caches(),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_reads_back_what_it_writes(msg: wire.Message) -> None:
    assert type(msg).decode(msg.encode()) == msg


def test_every_request_op_has_one_request_class() -> None:
    requests = [m for m in SAMPLES if isinstance(m, wire.Request)]
    assert {m.op for m in requests} == set(wire.RequestOp)
    for m in requests:
        assert wire.parse_request(m.op.value, m.encode()) == m


@pytest.mark.parametrize(
    "op,body,words",
    [
        ("invalidate", {}, "invalidate: cache_id must be int"),
        ("cache_by_id", {"cache_id": "1"}, "cache_by_id: cache_id must be int"),
        ("probe_back", {"timeout": 1}, "probe_back: timeout must be a float > 0"),
        ("probe_back", {"timeout": 1.0, "nonce": NONCE}, "probe_back: nonce must be"),
        ("cache_by_key", {"cluster_id": 1}, "cache_by_key: bad key"),
        ("blocks_by_key", {"cluster_id": -1, "model_id": 0}, "blocks_by_key: bad key"),
        ("cache_by_addr", {"addrs": [1] * (wire.MAX_ADDRS_PER_REQUEST + 1)}, "addrs must be"),
        ("nonsense", {}, "unknown request 'nonsense'"),
    ],
)
def test_a_malformed_request_is_param_invalid_naming_its_field(
    op: str, body: dict[str, Any], words: str
) -> None:
    with pytest.raises(LLMException) as info:
        wire.parse_request(op, body)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert words in str(info.value)


@pytest.mark.parametrize(
    "request_,body",
    [
        (wire.ProbeInfo(), {"addr": 1, "len": 64, "base": 1, "span": 64, "rkey": "k"}),
        (wire.ProbeInfo(), {"addr": 0, "len": 64, "base": 64, "span": 64, "rkey": b"k"}),
        (wire.ProbeInfo(), {"addr": True, "len": 64, "base": 1, "span": 64, "rkey": b"k"}),
        (wire.ProbeBack(1.0), {"problem": "", "nonce": b"short", "slot": 1}),
        (wire.CacheByKey(CacheKey(cluster_id=1, req_id=1)), {"batch_index": -1}),
        (wire.CacheByKey(CacheKey(cluster_id=1, req_id=1)), {"batch_index": True}),
        (wire.Caches(), {"caches": {}}),
        (wire.CacheByAddr((1,)), {"caches": [1]}),
    ],
)
def test_an_answer_that_does_not_fit_is_a_bad_reply(
    request_: wire.Request[Any], body: dict[str, Any]
) -> None:
    with pytest.raises(wire.BadReply):
        request_.reply(body)
