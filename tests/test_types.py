"""Tests for aiokvcache.errors and aiokvcache.types (plain sync tests)."""

from __future__ import annotations

import pickle
import socket
from typing import Any

import numpy as np
import pytest

from aiokvcache.errors import (
    InternalError,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    make_error,
    param_invalid,
)
from aiokvcache.types import (
    INVALID_ID,
    MAX_TAG_BYTES,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_cache_key,
    check_int,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_tag,
    check_uint32,
    check_uint64,
    is_valid_id,
)

U64 = 2**64 - 1
PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


def assert_param_invalid(excinfo: pytest.ExceptionInfo[LLMException], *words: str) -> None:
    assert excinfo.value.status_code == PARAM_INVALID
    for word in words:
        assert word in str(excinfo.value)


# ---------------------------------------------------------------- errors


STATUS_TABLE = {
    "WAIT_PROCESS_TIMEOUT": 1,
    "KV_CACHE_NOT_EXIST": 2,
    "REPEAT_REQUEST": 3,
    "REQUEST_ALREADY_COMPLETED": 4,
    "PARAM_INVALID": 5,
    "ENGINE_FINALIZED": 6,
    "NOT_YET_LINK": 7,
    "ALREADY_LINK": 8,
    "LINK_FAILED": 9,
    "UNLINK_FAILED": 10,
    "NOTIFY_PROMPT_UNLINK_FAILED": 11,
    "CLUSTER_NUM_EXCEED_LIMIT": 12,
    "PROCESSING_LINK": 13,
    "DEVICE_OUT_OF_MEMORY": 14,
    "PREFIX_ALREADY_EXIST": 15,
    "PREFIX_NOT_EXIST": 16,
    "SEQ_LEN_OVER_LIMIT": 17,
    "NO_FREE_BLOCK": 18,
    "BLOCKS_OUT_OF_MEMORY": 19,
    "EXIST_LINK": 24,
    "FEATURE_NOT_ENABLED": 25,
    "TIMEOUT": 26,
    "LINK_BUSY": 27,
    "OUT_OF_MEMORY": 28,
}


@pytest.mark.parametrize(("name", "offset"), sorted(STATUS_TABLE.items()))
def test_status_code_values(name: str, offset: int) -> None:
    assert LLMStatusCode["LLM_" + name] == 0x5010B000 + offset


def test_status_code_specials_and_alias() -> None:
    assert int(LLMStatusCode.LLM_SUCCESS) == 0
    assert int(LLMStatusCode.LLM_FAILED) == 0xFFFFFFFF
    assert int(LLMStatusCode.LLM_UNKNOWN_ERROR) == -1
    alias = LLMStatusCode["LLM_SEQ_LEN_OVER_LIMIT"]
    assert alias is LLMStatusCode.LLM_SEQ_LENOVERLIMIT
    # LLM-DataDist's Python spelling is the name; the C++ header's the alias.
    assert LLMStatusCode(0x5010B000 + 17).name == "LLM_SEQ_LENOVERLIMIT"
    assert int(LLMStatusCode.LLM_DEVICE_MEM_ERROR) == 507053
    assert int(LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR) == 507057
    # 24 distinct table codes + SUCCESS, FAILED, UNKNOWN_ERROR and the two
    # CANN runtime codes; the alias is not a member.
    assert len(LLMStatusCode) == len(STATUS_TABLE) + 5
    assert isinstance(LLMStatusCode.LLM_TIMEOUT, int)


def test_enums_print_like_llm_datadist() -> None:
    # Its samples log f"init {role} success" and compare printed statuses.
    assert str(LLMStatusCode.LLM_SUCCESS) == "LLMStatusCode.LLM_SUCCESS"
    assert f"{LLMStatusCode.LLM_TIMEOUT}" == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_TIMEOUT:x}" == "5010b01a"  # a numeric spec: the value
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT" and f"{LLMRole.DECODER}" == "LLMRole.DECODER"
    assert str(Placement.HOST) == "Placement.HOST"
    assert str(DataType.DT_FLOAT) == "DataType.DT_FLOAT"
    assert LLMRole.PROMPT == 1 and int(Placement.DEVICE) == 1  # still ints


def test_dt_string_is_named_but_not_a_cache_type() -> None:
    assert DataType.DT_STRING.value == 13
    with pytest.raises(ValueError, match="data_type"):
        CacheDesc(2, [4], DataType.DT_STRING)


def test_llm_exception() -> None:
    e = LLMException("boom", LLMStatusCode.LLM_LINK_FAILED)
    assert isinstance(e, RuntimeError)
    assert e.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert "LLM_LINK_FAILED" in str(e) and "boom" in str(e)
    assert LLMException("x").status_code is LLMStatusCode.LLM_FAILED
    assert LLMException("x", status_code=int(PARAM_INVALID)).status_code is PARAM_INVALID
    assert LLMException("x", 12345).status_code is LLMStatusCode.LLM_FAILED
    assert "LLM_LINK_FAILED" in repr(e)


def test_timeout_error_is_timeout() -> None:
    e = LLMTimeoutError("slow")
    assert e.status_code is LLMStatusCode.LLM_TIMEOUT
    assert isinstance(e, TimeoutError) and isinstance(e, LLMException)
    assert e.errno is None
    assert str(e) == "[LLM_TIMEOUT] slow"
    with pytest.raises(TimeoutError):
        raise LLMTimeoutError("t")


def test_internal_error() -> None:
    e = InternalError("bug")
    assert isinstance(e, LLMException)
    assert e.status_code is LLMStatusCode.LLM_UNKNOWN_ERROR


@pytest.mark.parametrize(
    "e",
    [
        LLMException("a", LLMStatusCode.LLM_NOT_YET_LINK),
        LLMTimeoutError("b"),
        InternalError("c"),
    ],
)
def test_exceptions_pickle(e: LLMException) -> None:
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e)
    assert back.status_code is e.status_code
    assert str(back) == str(e)


def test_make_error() -> None:
    t = make_error(LLMStatusCode.LLM_TIMEOUT, "late")
    assert type(t) is LLMTimeoutError and "late" in str(t)
    assert type(make_error(int(LLMStatusCode.LLM_TIMEOUT), "late")) is LLMTimeoutError
    p = make_error(PARAM_INVALID, "bad")
    assert type(p) is LLMException and p.status_code is PARAM_INVALID
    assert type(make_error(-1, "x")) is InternalError
    assert make_error(42, "x").status_code is LLMStatusCode.LLM_FAILED


def test_param_invalid() -> None:
    e = param_invalid("size is wrong")
    assert type(e) is LLMException
    assert e.status_code is PARAM_INVALID
    assert "size is wrong" in str(e)


# ---------------------------------------------------------------- checks


def test_check_int() -> None:
    assert check_int("n", 5, 0, 10) == 5
    assert check_int("n", 0, 0, 10) == 0
    assert check_int("n", 10, 0, 10) == 10
    assert check_int("n", -(10**30)) == -(10**30)
    value = check_int("n", np.int64(7), 0, 10)
    assert value == 7 and type(value) is int
    with pytest.raises(TypeError, match="n"):
        check_int("n", True, 0, 10)
    with pytest.raises(TypeError, match="n"):
        check_int("n", 1.0, 0, 10)
    with pytest.raises(TypeError, match="n"):
        check_int("n", "1", 0, 10)
    with pytest.raises(TypeError, match="n"):
        check_int("n", None, 0, 10)
    with pytest.raises(ValueError, match="n"):
        check_int("n", 11, 0, 10)
    with pytest.raises(ValueError, match="n"):
        check_int("n", -1, 0, 10)
    with pytest.raises(ValueError, match="n"):
        check_int("n", -1, 0, None)


def test_check_fixed_width() -> None:
    assert check_uint64("a", 0) == 0
    assert check_uint64("a", U64) == U64
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="a"):
            check_uint64("a", bad)
    assert check_uint32("b", 2**32 - 1) == 2**32 - 1
    with pytest.raises(ValueError, match="b"):
        check_uint32("b", 2**32)
    assert check_int64("c", -(2**63)) == -(2**63)
    with pytest.raises(ValueError, match="c"):
        check_int64("c", 2**63)
    with pytest.raises(TypeError, match="a"):
        check_uint64("a", False)


def test_check_isinstance() -> None:
    assert check_isinstance("x", "s", str) == "s"
    assert check_isinstance("x", b"s", (str, bytes)) == b"s"
    with pytest.raises(TypeError, match="x must be str or bytes"):
        check_isinstance("x", 1, (str, bytes))


def test_check_layer_range() -> None:
    assert check_layer_range("r", None) is None
    assert check_layer_range("r", range(0, 1)) == range(0, 1)
    assert check_layer_range("r", range(3, 7)) == range(3, 7)
    with pytest.raises(TypeError, match="r"):
        check_layer_range("r", [0, 1])
    with pytest.raises(TypeError, match="r"):
        check_layer_range("r", (0, 2))
    for bad in (range(0, 4, 2), range(2, 2), range(3, 1), range(-1, 2), range(4, 0, -1)):
        with pytest.raises(LLMException) as ei:
            check_layer_range("my_range", bad)
        assert_param_invalid(ei, "my_range")


def test_check_tag() -> None:
    assert check_tag("tag", None) is None
    assert check_tag("tag", "req-1") == "req-1"
    assert check_tag("tag", b"\x00\xff") == b"\x00\xff"
    assert check_tag("tag", b"x" * MAX_TAG_BYTES) is not None
    with pytest.raises(TypeError, match="tag"):
        check_tag("tag", 1)
    with pytest.raises(TypeError, match="tag"):
        check_tag("tag", bytearray(b"x"))
    with pytest.raises(ValueError, match="tag"):
        check_tag("tag", b"x" * (MAX_TAG_BYTES + 1))
    with pytest.raises(ValueError, match="tag"):
        check_tag("tag", "é" * (MAX_TAG_BYTES // 2 + 1))


# ---------------------------------------------------------------- enums


def test_data_type_values() -> None:
    expected = {
        "DT_FLOAT": 0,
        "DT_FLOAT16": 1,
        "DT_INT8": 2,
        "DT_INT32": 3,
        "DT_UINT8": 4,
        "DT_INT16": 6,
        "DT_UINT16": 7,
        "DT_UINT32": 8,
        "DT_INT64": 9,
        "DT_UINT64": 10,
        "DT_DOUBLE": 11,
        "DT_BOOL": 12,
        "DT_STRING": 13,
        "DT_BF16": 27,
    }
    assert {m.name: m.value for m in DataType} == expected


@pytest.mark.parametrize(
    ("np_type", "dt"),
    [
        (np.float32, DataType.DT_FLOAT),
        (np.float16, DataType.DT_FLOAT16),
        (np.int8, DataType.DT_INT8),
        (np.int32, DataType.DT_INT32),
        (np.uint8, DataType.DT_UINT8),
        (np.int16, DataType.DT_INT16),
        (np.uint16, DataType.DT_UINT16),
        (np.uint32, DataType.DT_UINT32),
        (np.int64, DataType.DT_INT64),
        (np.uint64, DataType.DT_UINT64),
        (np.float64, DataType.DT_DOUBLE),
        (np.bool_, DataType.DT_BOOL),
    ],
)
def test_data_type_numpy_round_trip(np_type: Any, dt: DataType) -> None:
    assert DataType.from_numpy(np_type) is dt
    assert DataType.from_numpy(np.dtype(np_type)) is dt
    assert DataType.from_numpy(np.dtype(np_type).name) is dt
    assert dt.to_numpy() == np.dtype(np_type)
    assert dt.itemsize == np.dtype(np_type).itemsize


def test_data_type_bf16() -> None:
    assert DataType.from_numpy("bfloat16") is DataType.DT_BF16
    assert DataType.from_numpy("torch.bfloat16") is DataType.DT_BF16
    assert DataType.DT_BF16.itemsize == 2
    assert DataType.DT_BF16.to_numpy() == np.dtype(np.uint16)

    class bfloat16:  # stands in for ml_dtypes.bfloat16, matched by name
        pass

    assert DataType.from_numpy(bfloat16) is DataType.DT_BF16


def test_data_type_from_numpy_misc() -> None:
    assert DataType.from_numpy(DataType.DT_INT8) is DataType.DT_INT8
    assert DataType.from_numpy("f2") is DataType.DT_FLOAT16
    assert DataType.from_numpy("torch.float16") is DataType.DT_FLOAT16
    assert DataType.from_numpy(float) is DataType.DT_DOUBLE
    assert DataType.from_numpy(bool) is DataType.DT_BOOL


@pytest.mark.parametrize(
    "bad", [np.complex64, "complex128", "no-such-type", object, ">f4", 3, None, np.dtype("U4")]
)
def test_data_type_from_numpy_rejects(bad: Any) -> None:
    with pytest.raises(TypeError):
        DataType.from_numpy(bad)


def test_placement_and_role() -> None:
    assert (Placement.HOST, Placement.DEVICE) == (0, 1)
    assert (LLMRole.PROMPT, LLMRole.DECODER, LLMRole.MIX) == (1, 2, 3)


# ---------------------------------------------------------------- CacheDesc


def test_cache_desc_defaults_and_props() -> None:
    d = CacheDesc(80, [4, 2048, 1, 128], DataType.DT_FLOAT16)
    assert d.num_tensors == 80
    assert d.shape == (4, 2048, 1, 128)
    assert d.data_type is DataType.DT_FLOAT16
    assert d.placement is Placement.DEVICE
    assert d.batch_dim_index == 0 and d.batch_dim == 0
    assert d.seq_len_dim_index == -1
    assert d.kv_tensor_format is None
    assert d.batch_size == 4
    assert d.size == 4 * 2048 * 128 * 2
    assert "num_tensors=80" in repr(d) and "Placement.DEVICE" in repr(d)


def test_cache_desc_all_args() -> None:
    d = CacheDesc(2, (3, 5, 7), DataType.DT_BF16, Placement.HOST, 1, 2, "ND")
    assert d.placement is Placement.HOST
    assert d.batch_size == 5
    assert d.seq_len_dim_index == 2
    assert d.kv_tensor_format == "ND"
    assert d.size == 3 * 5 * 7 * 2
    # Placement given as a plain int is converted.
    assert CacheDesc(1, [1], DataType.DT_INT8, 0).placement is Placement.HOST


def test_cache_desc_edges() -> None:
    assert CacheDesc(1, [0], DataType.DT_INT8).size == 0
    assert CacheDesc(1, [1] * 32, DataType.DT_INT8).size == 1
    assert CacheDesc(2**32 - 1, [1], DataType.DT_INT8).num_tensors == 2**32 - 1
    assert CacheDesc(1, [2, 3], DataType.DT_INT8, batch_dim_index=1).batch_size == 3
    assert CacheDesc(1, [2, 3], DataType.DT_INT8, seq_len_dim_index=0).seq_len_dim_index == 0
    assert CacheDesc(1, [np.int64(4)], DataType.DT_INT8).shape == (4,)  # type: ignore[list-item]


def test_cache_desc_eq_hash() -> None:
    a = CacheDesc(2, [4, 8], DataType.DT_FLOAT)
    b = CacheDesc(2, (4, 8), DataType.DT_FLOAT, Placement.DEVICE)
    c = CacheDesc(2, [4, 8], DataType.DT_FLOAT, Placement.HOST)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != "CacheDesc"
    assert len({a, b, c}) == 2


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"num_tensors": 1.0}, "num_tensors"),
        ({"num_tensors": True}, "num_tensors"),
        ({"shape": "4,4"}, "shape"),
        ({"shape": 4}, "shape"),
        ({"shape": [4, 4.0]}, "shape[1]"),
        ({"shape": [4, True]}, "shape[1]"),
        ({"data_type": np.float16}, "data_type"),
        ({"data_type": 1}, "data_type"),
        ({"placement": "HOST"}, "placement"),
        ({"placement": True}, "placement"),
        ({"batch_dim_index": 0.0}, "batch_dim_index"),
        ({"seq_len_dim_index": None}, "seq_len_dim_index"),
        ({"kv_tensor_format": 1}, "kv_tensor_format"),
    ],
)
def test_cache_desc_type_errors(kwargs: dict[str, Any], word: str) -> None:
    args: dict[str, Any] = {"num_tensors": 2, "shape": [4, 4], "data_type": DataType.DT_FLOAT}
    args.update(kwargs)
    with pytest.raises(TypeError, match=word.replace("[", r"\[").replace("]", r"\]")):
        CacheDesc(**args)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"num_tensors": 0}, "num_tensors"),
        ({"num_tensors": -1}, "num_tensors"),
        ({"num_tensors": 2**32}, "num_tensors"),
        ({"shape": []}, "shape"),
        ({"shape": [1] * 33}, "shape"),
        ({"shape": [4, -1]}, "shape"),
        ({"shape": [2**63]}, "shape"),
        ({"shape": [2**62, 4]}, "shape"),
        ({"placement": 2}, "placement"),
        ({"batch_dim_index": 2}, "batch_dim_index"),
        ({"batch_dim_index": -1}, "batch_dim_index"),
        ({"seq_len_dim_index": 2}, "seq_len_dim_index"),
        ({"seq_len_dim_index": -2}, "seq_len_dim_index"),
    ],
)
def test_cache_desc_value_errors(kwargs: dict[str, Any], word: str) -> None:
    args: dict[str, Any] = {"num_tensors": 2, "shape": [4, 4], "data_type": DataType.DT_FLOAT}
    args.update(kwargs)
    with pytest.raises(ValueError, match=word):
        CacheDesc(**args)


# ---------------------------------------------------------------- Cache


def test_cache_host_tensors_and_invalidate() -> None:
    desc = CacheDesc(2, [2, 3], DataType.DT_FLOAT16, Placement.HOST)
    arrays = [np.zeros(desc.shape, desc.data_type.to_numpy()) for _ in range(2)]
    owner = object()
    addrs = [a.ctypes.data for a in arrays]
    cache = Cache(1, desc, addrs, arrays=arrays, owner=owner)
    assert cache.cache_id == 1
    assert cache.cache_desc is desc
    assert cache.tensor_addrs == addrs
    assert cache.is_blocks_cache is False
    tensors = cache.tensors
    assert len(tensors) == 2 and tensors[0] is arrays[0]
    assert tensors[1].shape == (2, 3) and tensors[1].dtype == np.float16
    assert cache._owner is owner and cache._valid
    assert "cache_id=1" in repr(cache)

    cache._invalidate()
    assert not cache._valid
    assert cache.tensor_addrs == []
    assert cache._owner is None
    with pytest.raises(LLMException) as ei:
        _ = cache.tensors
    assert ei.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert "deallocated" in repr(cache)


def test_cache_without_arrays() -> None:
    desc = CacheDesc(1, [4], DataType.DT_INT8)
    cache = Cache(7, desc, [0x1000], True)
    assert cache.is_blocks_cache is True
    with pytest.raises(LLMException) as ei:
        _ = cache.tensors
    assert ei.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_cache_validates_fields() -> None:
    desc = CacheDesc(1, [4], DataType.DT_INT8)
    with pytest.raises(TypeError, match="cache_id"):
        Cache("1", desc, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_desc"):
        Cache(1, "desc", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_addrs"):
        Cache(1, desc, [-1])


# ---------------------------------------------------------------- keys


def test_cache_key_basics() -> None:
    k = CacheKey(0, 1)
    assert (k.cluster_id, k.prompt_cluster_id, k.req_id, k.model_id, k.prefix_id) == (
        0,
        0,
        1,
        0,
        INVALID_ID,
    )
    assert CacheKey(prompt_cluster_id=3, req_id=4) == CacheKey(cluster_id=3, req_id=4)
    assert CacheKey(1, 2, 3, 4).prefix_id == 4
    assert CacheKey(U64, U64, U64, U64).cluster_id == U64
    assert "req_id=1" in repr(k)


def test_cache_key_hash_eq() -> None:
    a, b, c = CacheKey(1, 2), CacheKey(1, 2, 0), CacheKey(1, 2, 1)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    assert a != CacheKeyByIdAndIndex(1, 2)
    assert {a: "x"}[CacheKey(1, 2)] == "x"


def test_cache_key_errors() -> None:
    with pytest.raises(TypeError, match="cluster_id"):
        CacheKey(req_id=1)
    with pytest.raises(TypeError, match="req_id"):
        CacheKey(1)
    with pytest.raises(TypeError, match="not both"):
        CacheKey(cluster_id=1, req_id=2, prompt_cluster_id=1)
    with pytest.raises(TypeError, match="cluster_id"):
        CacheKey("0", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt_cluster_id"):
        CacheKey(prompt_cluster_id=1.5, req_id=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="req_id"):
        CacheKey(0, True)
    with pytest.raises(TypeError, match="model_id"):
        CacheKey(0, 1, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefix_id"):
        CacheKey(0, 1, 0, "p")  # type: ignore[arg-type]
    for field_index, name in enumerate(["cluster_id", "req_id", "model_id", "prefix_id"]):
        for bad in (-1, 2**64):
            args = [0, 1, 0, INVALID_ID]
            args[field_index] = bad
            with pytest.raises(ValueError, match=name):
                CacheKey(*args)


def test_cache_key_req_prefix_rule() -> None:
    check_cache_key("cache_key", CacheKey(0, 1))
    check_cache_key("cache_key", CacheKey(0, INVALID_ID, prefix_id=5))
    placeholder = CacheKey(0, INVALID_ID)  # allowed to exist: allocate_cache placeholder
    assert placeholder.is_placeholder
    assert not CacheKey(0, 1).is_placeholder
    with pytest.raises(LLMException) as ei:
        check_cache_key("cache_key", placeholder)
    assert_param_invalid(ei, "cache_key", "neither")
    with pytest.raises(LLMException) as ei:
        check_cache_key("src_cache_key", CacheKey(0, 1, prefix_id=2))
    assert_param_invalid(ei, "src_cache_key", "both")
    assert is_valid_id(0) and is_valid_id(U64 - 1) and not is_valid_id(U64)


def test_cache_key_by_id_and_index() -> None:
    k = CacheKeyByIdAndIndex(1, 2)
    assert (k.cluster_id, k.cache_id, k.batch_index) == (1, 2, 0)
    assert CacheKeyByIdAndIndex(U64, 2**63 - 1, 2**32 - 1).batch_index == 2**32 - 1
    assert CacheKeyByIdAndIndex(1, -1).cache_id == -1
    assert k == CacheKeyByIdAndIndex(1, 2, 0) and hash(k) == hash(CacheKeyByIdAndIndex(1, 2))
    assert k != CacheKeyByIdAndIndex(1, 2, 1)
    assert "cache_id=2" in repr(k)
    with pytest.raises(TypeError, match="cluster_id"):
        CacheKeyByIdAndIndex("1", 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_id"):
        CacheKeyByIdAndIndex(1, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_index"):
        CacheKeyByIdAndIndex(1, 2, False)
    with pytest.raises(ValueError, match="cluster_id"):
        CacheKeyByIdAndIndex(-1, 2)
    with pytest.raises(ValueError, match="cache_id"):
        CacheKeyByIdAndIndex(1, 2**63)
    with pytest.raises(ValueError, match="batch_index"):
        CacheKeyByIdAndIndex(1, 2, -1)
    with pytest.raises(ValueError, match="batch_index"):
        CacheKeyByIdAndIndex(1, 2, 2**32)


def test_blocks_cache_key() -> None:
    k = BlocksCacheKey(1)
    assert (k.cluster_id, k.prompt_cluster_id, k.model_id) == (1, 1, 0)
    assert BlocksCacheKey(prompt_cluster_id=2, model_id=3) == BlocksCacheKey(2, 3)
    assert hash(BlocksCacheKey(2, 3)) == hash(BlocksCacheKey(cluster_id=2, model_id=3))
    assert BlocksCacheKey(1) != BlocksCacheKey(1, 1)
    assert BlocksCacheKey(1) != CacheKeyByIdAndIndex(1, 0)
    assert "model_id=0" in repr(k)
    with pytest.raises(TypeError, match="cluster_id"):
        BlocksCacheKey()
    with pytest.raises(TypeError, match="not both"):
        BlocksCacheKey(1, prompt_cluster_id=1)
    with pytest.raises(TypeError, match="model_id"):
        BlocksCacheKey(1, "0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cluster_id"):
        BlocksCacheKey(2**64)
    with pytest.raises(ValueError, match="model_id"):
        BlocksCacheKey(1, -1)


# ---------------------------------------------------------------- LLMClusterInfo


def test_cluster_info() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None and info.remote_role_type is None
    info.remote_cluster_id = U64
    info.remote_role_type = LLMRole.PROMPT
    assert info.remote_cluster_id == U64 and info.remote_role_type is LLMRole.PROMPT
    info.remote_role_type = 2
    assert info.remote_role_type is LLMRole.DECODER

    info.append_local_ip_info("10.0.0.1", 0)
    info.append_remote_ip_info("192.168.1.1", 26000)
    as_int = int.from_bytes(socket.inet_aton("127.0.0.1"), "little")
    info.append_remote_ip_info(as_int, 65535)
    assert info.local_ip_info == [("10.0.0.1", 0)]
    assert info.remote_ip_info == [("192.168.1.1", 26000), ("127.0.0.1", 65535)]
    assert info.remote_ip_info_list[1] == (as_int, 65535)
    assert info.local_ip_info_list == [(int.from_bytes(socket.inet_aton("10.0.0.1"), "little"), 0)]
    # The getters return copies.
    info.local_ip_info.clear()
    assert len(info.local_ip_info) == 1
    assert "remote_cluster_id" in repr(info)


def test_cluster_info_errors() -> None:
    info = LLMClusterInfo()
    with pytest.raises(TypeError, match="remote_cluster_id"):
        info.remote_cluster_id = "1"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="remote_cluster_id"):
        info.remote_cluster_id = -1
    with pytest.raises(TypeError, match="remote_role_type"):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="remote_role_type"):
        info.remote_role_type = 4
    with pytest.raises(TypeError, match="ip"):
        info.append_local_ip_info(1.0, 80)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ip"):
        info.append_local_ip_info(True, 80)
    with pytest.raises(ValueError, match="ip"):
        info.append_local_ip_info("256.0.0.1", 80)
    with pytest.raises(ValueError, match="ip"):
        info.append_remote_ip_info("example.com", 80)
    with pytest.raises(ValueError, match="ip"):
        info.append_remote_ip_info(2**32, 80)
    with pytest.raises(ValueError, match="port"):
        info.append_local_ip_info("1.2.3.4", 65536)
    with pytest.raises(ValueError, match="port"):
        info.append_local_ip_info("1.2.3.4", -1)
    with pytest.raises(TypeError, match="port"):
        info.append_local_ip_info("1.2.3.4", "80")  # type: ignore[arg-type]
    assert info.local_ip_info == [] and info.remote_ip_info == []


# ---------------------------------------------------------------- transfer configs


def test_transfer_config() -> None:
    c = TransferConfig(1, [0x1000, 0x2000])
    assert c.dst_cluster_id == 1
    assert c.dst_addrs == [0x1000, 0x2000]
    assert c.src_layer_range is None and c.dst_layer_range is None
    assert c.src_batch_index == 0 and c.tag is None
    c2 = TransferConfig(2, (1, 2, 3, 4), range(0, 2), 1, tag=b"t")
    assert c2.src_layer_range == range(0, 2) and c2.src_batch_index == 1 and c2.tag == b"t"
    assert "dst_cluster_id=2" in repr(c2)
    c2.dst_cluster_id = 5
    c2.dst_addrs = [9]
    c2.src_layer_range = None
    c2.src_batch_index = 3
    c2.tag = "s"
    assert (c2.dst_cluster_id, c2.dst_addrs, c2.src_batch_index, c2.tag) == (5, [9], 3, "s")


def test_transfer_config_errors() -> None:
    with pytest.raises(TypeError, match="dst_cluster_id"):
        TransferConfig("1", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dst_cluster_id"):
        TransferConfig(-1, [1])
    with pytest.raises(TypeError, match="dst_addrs"):
        TransferConfig(1, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst_addrs"):
        TransferConfig(1, [1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="dst_addrs"):
        TransferConfig(1, [-1])
    with pytest.raises(TypeError, match="src_layer_range"):
        TransferConfig(1, [1], [0, 1])  # type: ignore[arg-type]
    with pytest.raises(LLMException) as ei:
        TransferConfig(1, [1], range(0, 4, 2))
    assert_param_invalid(ei, "src_layer_range")
    with pytest.raises(ValueError, match="src_batch_index"):
        TransferConfig(1, [1], None, -1)
    with pytest.raises(TypeError, match="tag"):
        TransferConfig(1, [1], tag=1)  # type: ignore[arg-type]
    c = TransferConfig(1, [1])
    with pytest.raises(LLMException) as ei:
        c.src_layer_range = range(2, 1)
    assert_param_invalid(ei, "src_layer_range")
    with pytest.raises(ValueError, match="src_batch_index"):
        c.src_batch_index = 2**32


def test_transfer_with_cache_key_config() -> None:
    key = CacheKeyByIdAndIndex(3, 7, 1)
    c = TransferWithCacheKeyConfig(key, range(0, 2), range(4, 6), 2, tag="x")
    assert c.cache_key is key and c.dst_cluster_id == 3
    assert (c.src_layer_range, c.dst_layer_range) == (range(0, 2), range(4, 6))
    assert c.src_batch_index == 2 and c.tag == "x"
    assert "cache_key=CacheKeyByIdAndIndex" in repr(c)
    # [ours] None means all layers
    d = TransferWithCacheKeyConfig(BlocksCacheKey(1))
    assert d.src_layer_range is None and d.dst_layer_range is None and d.src_batch_index == 0
    d.src_layer_range = range(0, 3)
    d.dst_layer_range = range(1, 4)
    d.cache_key = key
    d.src_batch_index = 4
    d.tag = b"y"
    assert (d.dst_cluster_id, d.src_batch_index, d.tag) == (3, 4, b"y")


def test_transfer_with_cache_key_config_errors() -> None:
    key = CacheKeyByIdAndIndex(3, 7)
    with pytest.raises(TypeError, match="cache_key"):
        TransferWithCacheKeyConfig(CacheKey(0, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src_layer_range"):
        TransferWithCacheKeyConfig(key, 3)  # type: ignore[arg-type]
    with pytest.raises(LLMException) as ei:
        TransferWithCacheKeyConfig(key, range(0, 2), range(-1, 1))
    assert_param_invalid(ei, "dst_layer_range")
    with pytest.raises(LLMException) as ei:
        TransferWithCacheKeyConfig(key, range(0, 2), range(0, 3))
    assert_param_invalid(ei, "same length")
    with pytest.raises(LLMException) as ei:
        TransferWithCacheKeyConfig(BlocksCacheKey(1), None, None, 1)
    assert_param_invalid(ei, "src_batch_index", "BlocksCacheKey")
    with pytest.raises(ValueError, match="src_batch_index"):
        TransferWithCacheKeyConfig(key, None, None, -1)
    with pytest.raises(TypeError, match="tag"):
        TransferWithCacheKeyConfig(key, tag=["t"])  # type: ignore[arg-type]

    c = TransferWithCacheKeyConfig(key, range(0, 2), range(0, 2), 1)
    with pytest.raises(LLMException) as ei:
        c.dst_layer_range = range(0, 5)
    assert_param_invalid(ei, "same length")
    assert c.dst_layer_range == range(0, 2)
    with pytest.raises(LLMException) as ei:
        c.cache_key = BlocksCacheKey(1)  # src_batch_index is 1
    assert_param_invalid(ei, "BlocksCacheKey")
    assert c.cache_key is key
    b = TransferWithCacheKeyConfig(BlocksCacheKey(1))
    with pytest.raises(LLMException) as ei:
        b.src_batch_index = 1
    assert_param_invalid(ei, "src_batch_index")


def test_layer_synchronizer_abc() -> None:
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Sync(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return layer_index < 2

    class AsyncSync(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    assert Sync().synchronize_layer(1, None) is True
    assert Sync().synchronize_layer(2, 100) is False
    coro = AsyncSync().synchronize_layer(0, None)
    coro.close()
