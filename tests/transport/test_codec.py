"""Tests for transport.codec (msgpack + out-of-band tensor frames) and protocol.Layout."""

from __future__ import annotations

import random
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from transport import codec
from transport.batch import TensorBatch
from transport.codec import (
    EXT_BATCH,
    EXT_NDARRAY,
    EXT_TENSOR,
    INLINE_BYTES,
    SHM_MIN_BYTES,
    Encoded,
    decode,
    encode,
)
from transport.protocol import PROTOCOL_VERSION, Layout, Message, MsgType, ProtocolError
from transport.shm import ShmArena, ShmReader

MIB = 1 << 20
ALL_DTYPES = sorted(codec._DTYPES)
# Dtypes narrower than a byte: torch has no copy kernel for them; the codec copies them as bytes.
SUB_BYTE = {f"{kind}{bits}" for kind in ("uint", "int") for bits in range(1, 8)}


# ---------------------------------------------------------------------------------- helpers
def _reply(x: Any) -> Message:
    return Message(MsgType.REPLY, 7, {"result": x})


def _roundtrip(x: Any) -> Any:
    msg = decode(encode(_reply(x)).frames)
    assert msg.type is MsgType.REPLY
    assert msg.call_id == 7
    return msg.body["result"]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (works for fp8, uint1, bits16, ...)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    high = 2 if dtype == torch.bool else 256  # only 0/1 are valid bool bytes
    raw = torch.randint(0, high, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor."""
    assert t.is_contiguous()
    return t.reshape(-1).view(torch.uint8)


def _assert_same(out: Any, ref: torch.Tensor) -> None:
    assert isinstance(out, torch.Tensor)
    assert out.dtype == ref.dtype
    assert tuple(out.shape) == tuple(ref.shape)
    assert torch.equal(_raw(out.contiguous()), _raw(ref))


def _tensor_ext(dtype: Any, shape: Any, where: Any) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([dtype, shape, where], use_bin_type=True))


def _ndarray_ext(dtype: Any, shape: Any, where: Any) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([dtype, shape, where], use_bin_type=True))


def _header(
    body: Any = None, version: Any = PROTOCOL_VERSION, type_: Any = 5, call_id: Any = 1
) -> bytes:
    if body is None:
        body = {"result": None}
    return msgpack.packb([version, type_, call_id, body], use_bin_type=True)


# ---------------------------------------------------------------------------------- fixtures


# ---------------------------------------------------------------------------------- 1. dtypes
def test_dtype_table_is_complete_and_has_no_quantized_types() -> None:
    for name in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "complex32", "bool"):
        assert name in codec._DTYPES
    for name in ("uint16", "uint64", "uint1", "int4", "bits16", "float4_e2m1fn_x2"):
        assert name in codec._DTYPES
    assert all("qint" not in name and "quint" not in name for name in codec._DTYPES)
    assert all(codec._DTYPES[name] == getattr(torch, name) for name in codec._DTYPES)


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
@pytest.mark.parametrize("elements", [12, 3000], ids=["inline", "frame"])
def test_every_dtype_round_trips_bit_exact(dtype_name: str, elements: int) -> None:
    dtype = codec._DTYPES[dtype_name]
    t = _random_tensor(dtype, (3, elements // 3), seed=elements)
    enc = encode(_reply(t))
    nbytes = t.numel() * dtype.itemsize
    assert len(enc.frames) == (1 if nbytes < INLINE_BYTES else 2)
    _assert_same(decode(enc.frames).body["result"], t)


def test_bfloat16_values_round_trip() -> None:
    t = torch.tensor([1.5, -2.25, 0.0, 3.0e38, float("inf")], dtype=torch.bfloat16)
    out = _roundtrip(t)
    _assert_same(out, t)
    assert out.tolist() == t.tolist()
    big = torch.randn(1024, 3).to(torch.bfloat16)
    _assert_same(_roundtrip(big), big)


@pytest.mark.parametrize("dtype_name", ["float32", "int64", "complex128", "float16", "bool"])
def test_zero_d_scalar_keeps_its_shape(dtype_name: str) -> None:
    t = _random_tensor(codec._DTYPES[dtype_name], (), seed=3)
    out = _roundtrip(t)
    assert out.ndim == 0
    _assert_same(out, t)


# ---------------------------------------------------------------------------------- 2. shapes
def _frames_for(x: Any) -> int:
    """Frames added on top of the header."""
    return len(encode(_reply(x)).frames) - 1


def test_non_contiguous_tensors_round_trip() -> None:
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    for t in (base.t(), base[:, ::3], base[::2, 1::4], base.t()[3:9]):
        assert not t.is_contiguous()
        out = _roundtrip(t)
        assert out.is_contiguous()
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out, t)
    big = torch.arange(64 * 64, dtype=torch.int64).reshape(64, 64).t()
    assert _frames_for(big) == 1
    assert torch.equal(_roundtrip(big), big)


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
@pytest.mark.parametrize("layout", ["slice_small", "transposed_big"])
def test_non_contiguous_every_dtype(dtype_name: str, layout: str, request: Any) -> None:
    dtype = codec._DTYPES[dtype_name]
    if layout == "slice_small":
        full = _random_tensor(dtype, (8, 12), seed=5)
        t = full[:, ::3]
    else:
        full = _random_tensor(dtype, (64, 64), seed=6)  # square: torch's transpose-copy path
        t = full.t()
    assert not t.is_contiguous()
    # Expected bytes built without a copy kernel: gather the uint8 view (same itemsize) instead.
    ref_bytes = full.view(torch.uint8) if dtype.itemsize == 1 else None
    out = _roundtrip(t)
    assert out.dtype == dtype and out.shape == t.shape
    if ref_bytes is not None:
        expect = ref_bytes[:, ::3] if layout == "slice_small" else ref_bytes.t()
        assert torch.equal(_raw(out).reshape(expect.shape), expect.contiguous())
    else:
        assert torch.equal(_raw(out), _raw(t.contiguous()))


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 100000)])
def test_empty_tensors_round_trip_and_add_no_frame(shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=torch.float64)
    assert _frames_for(t) == 0
    out = _roundtrip(t)
    assert out.dtype == torch.float64
    assert tuple(out.shape) == shape
    assert out.numel() == 0


def test_one_element_and_scalar_stay_distinct() -> None:
    one = torch.tensor([2.5])
    scalar = torch.tensor(2.5)
    out_one, out_scalar = _roundtrip([one, scalar])
    assert tuple(out_one.shape) == (1,) and out_one.item() == 2.5
    assert tuple(out_scalar.shape) == () and out_scalar.item() == 2.5
    assert _frames_for([one, scalar]) == 0


def test_inline_threshold_is_exact() -> None:
    below = torch.zeros(INLINE_BYTES - 1, dtype=torch.uint8)
    at = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
    assert _frames_for(below) == 0
    assert _frames_for(at) == 1
    assert _frames_for(torch.zeros(INLINE_BYTES // 4 - 1, dtype=torch.float32)) == 0
    assert _frames_for(torch.zeros(INLINE_BYTES // 4, dtype=torch.float32)) == 1


def test_each_big_tensor_adds_exactly_one_frame() -> None:
    big = [torch.full((200,), float(i)) for i in range(3)]  # 800 bytes each
    small = [torch.ones(4), torch.tensor(1), torch.empty(0)]
    body = {"a": big[0], "b": [small[0], big[1], {"c": big[2], "d": small[1]}], "e": small[2]}
    enc = encode(_reply(body))
    assert len(enc.frames) == 1 + 3
    out = decode(enc.frames).body["result"]
    assert torch.equal(out["a"], big[0])
    assert torch.equal(out["b"][1], big[1])
    assert torch.equal(out["b"][2]["c"], big[2])
    assert torch.equal(out["b"][0], small[0])
    assert out["e"].shape == (0,)


def test_big_flag_only_for_frames_of_64k_or_more() -> None:
    assert encode(_reply(torch.ones(4))).big is False
    assert encode(_reply(torch.zeros(65535, dtype=torch.uint8))).big is False
    assert encode(_reply(torch.zeros(65536, dtype=torch.uint8))).big is True
    mixed = [torch.zeros(1000, dtype=torch.uint8), torch.zeros(70000, dtype=torch.uint8)]
    assert encode(_reply(mixed)).big is True
    # A header over 64 KiB (inline bytes, long strings) is not a tracked frame.
    assert encode(_reply("x" * 100_000)).big is False


def test_encoded_nbytes_counts_all_frames() -> None:
    t = torch.zeros(1000, dtype=torch.float32)
    enc = encode(_reply(t))
    assert isinstance(enc, Encoded)
    assert enc.nbytes == len(enc.frames[0]) + 4000


# ---------------------------------------------------------------------------------- 3/4. aliasing
def test_receive_is_zero_copy_over_writable_frames() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    enc = encode(_reply(t))
    frames: list[Any] = [enc.frames[0]] + [bytearray(f.tobytes()) for f in enc.frames[1:]]
    out = decode(frames).body["result"]
    assert torch.equal(out, t)
    frames[1][0:4] = (123456).to_bytes(4, "little")
    assert out[0].item() == 123456
    out[1] = -5
    assert int.from_bytes(frames[1][4:8], "little", signed=True) == -5


def test_numpy_receive_is_zero_copy_over_writable_frames() -> None:
    a = np.arange(500, dtype=np.float64)
    enc = encode(_reply(a))
    frames: list[Any] = [enc.frames[0], bytearray(enc.frames[1].tobytes())]
    out = decode(frames).body["result"]
    frames[1][0:8] = np.float64(7.5).tobytes()
    assert out[0] == 7.5


def test_frames_are_zero_copy_views_of_the_senders_tensor() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    enc = encode(_reply(t))
    assert np.shares_memory(enc.frames[1], t.numpy())


def test_inline_bytes_do_not_alias_the_senders_tensor() -> None:
    t = torch.arange(10, dtype=torch.float32)
    expect = t.clone()
    enc = encode(_reply(t))
    t.add_(100)
    assert torch.equal(decode(enc.frames).body["result"], expect)


def test_inline_decoded_tensors_do_not_alias_each_other() -> None:
    enc = encode(_reply(torch.ones(4)))
    first = decode(enc.frames).body["result"]
    second = decode(enc.frames).body["result"]
    first.zero_()
    assert torch.equal(second, torch.ones(4))


# ---------------------------------------------------------------------------------- 5. types
@pytest.mark.parametrize(
    "array",
    [
        np.linspace(-1, 1, 7, dtype=np.float32),
        np.arange(-5, 300, dtype=np.int64),
        np.array([True, False, True]),
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(2000, dtype=np.float32).reshape(40, 50),
        np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
        np.arange(12, dtype=np.int32).reshape(3, 4).T,
        np.array(3.25),
        np.zeros((2, 0), dtype=np.int8),
        np.arange(6, dtype=">i4"),
    ],
    ids=["f32", "i64", "bool", "2d", "2d_frame", "fortran", "transposed", "0d", "empty", "be_i4"],
)
def test_numpy_round_trip(array: np.ndarray) -> None:
    out = _roundtrip(array)
    assert isinstance(out, np.ndarray)
    assert out.dtype == array.dtype
    assert out.shape == array.shape
    assert np.array_equal(out, array)


def test_numpy_scalars_become_python_values() -> None:
    out = _roundtrip([np.float32(1.5), np.int64(-3), np.bool_(True)])
    assert out == [1.5, -3, True]
    assert [type(v) for v in out] == [float, int, bool]


def test_numpy_object_array_is_refused() -> None:
    with pytest.raises(TypeError, match="object"):
        encode(_reply(np.array([1, "a", None], dtype=object)))


@pytest.mark.parametrize("obj", [object(), {1, 2}, frozenset(), complex(1, 2), Layout()], ids=type)
def test_unknown_objects_are_refused_without_pickle(obj: Any) -> None:
    with pytest.raises(TypeError, match="no pickle"):
        encode(_reply(obj))
    with pytest.raises(TypeError, match="no pickle"):
        encode(_reply({"nested": [1, obj]}))


def test_quantized_tensor_is_refused() -> None:
    q = torch.quantize_per_tensor(torch.randn(4), scale=0.1, zero_point=0, dtype=torch.qint8)
    with pytest.raises(TypeError, match="quantized"):
        encode(_reply(q))


def test_tensor_requiring_grad_is_sent_detached() -> None:
    t = torch.randn(5, requires_grad=True)
    out = _roundtrip(t * 2)
    assert not out.requires_grad
    assert torch.equal(out, (t * 2).detach())


def test_tuples_come_back_as_lists() -> None:
    out = _roundtrip((1, (2, 3), [4, (5,)], {"k": (torch.ones(2), "s")}))
    assert out[:3] == [1, [2, 3], [4, [5]]]
    assert type(out) is list and type(out[1]) is list
    assert type(out[3]["k"]) is list
    assert torch.equal(out[3]["k"][0], torch.ones(2)) and out[3]["k"][1] == "s"


def test_nested_containers_round_trip() -> None:
    body = {
        "lists": [torch.arange(3), [torch.zeros(2, 2), torch.ones(300)], []],
        "dicts": {"x": {"y": torch.tensor(True)}, "n": None, "f": 1.5, "b": b"\x00\xff"},
        1: "int key",
    }
    out = _roundtrip(body)
    assert set(out) == {"lists", "dicts", 1}
    assert torch.equal(out["lists"][0], torch.arange(3))
    assert torch.equal(out["lists"][1][0], torch.zeros(2, 2))
    assert torch.equal(out["lists"][1][1], torch.ones(300))
    assert out["lists"][2] == []
    assert out["dicts"]["x"]["y"].item() is True
    assert out["dicts"]["n"] is None and out["dicts"]["f"] == 1.5
    assert out["dicts"]["b"] == b"\x00\xff"
    assert out[1] == "int key"


def test_tensor_batch_round_trips() -> None:
    batch = TensorBatch(
        tensors={
            "ids": torch.arange(12).reshape(4, 3),
            "logp": torch.randn(4, 200),  # big: a frame
            "mask": torch.tensor([True, False, True, True]),
            "bf": torch.randn(4, 2).to(torch.bfloat16),
        },
        non_tensors={
            "prompt": ["a", "bb", "", "ünïcode"],
            "info": [{"k": 1}, {"k": [1, 2]}, {}, {"nested": {"x": None}}],
        },
        meta={"temperature": 0.7, "step": 3, "tags": ["x", "y"]},
    )
    enc = encode(_reply({"batch": batch, "batches": [batch, TensorBatch()]}))
    assert len(enc.frames) == 1 + 2  # logp twice
    out = decode(enc.frames).body["result"]
    assert isinstance(out["batch"], TensorBatch)
    assert out["batch"].equals(batch)
    assert out["batches"][0].equals(batch)
    assert out["batches"][1].equals(TensorBatch())
    changed = TensorBatch(batch.tensors, batch.non_tensors, {**batch.meta, "step": 4})
    assert not out["batch"].equals(changed)


def test_tensor_batch_slice_view_round_trips() -> None:
    batch = TensorBatch({"x": torch.arange(40).reshape(10, 4).t().contiguous().t()})
    part = batch[2:7]
    out = _roundtrip(part)
    assert out.equals(part)
    assert len(out) == 5


# ---------------------------------------------------------------------------------- 6. shared memory
def test_big_tensor_goes_through_shared_memory(arena: ShmArena, reader: ShmReader) -> None:
    t = _random_tensor(torch.float32, (MIB // 4 + 3,), seed=11)  # a bit over 1 MiB
    enc = encode(_reply({"t": t, "small": torch.ones(3)}), arena=arena, readers=1)
    assert len(enc.frames) == 1  # a descriptor in the header, no frame
    assert enc.big is False
    assert len(enc.frames[0]) < 4096
    t_ref = t.clone()
    t.zero_()  # the arena copied the bytes: the sender may reuse its tensor
    out = decode(enc.frames, reader=reader).body["result"]
    _assert_same(out["t"], t_ref)
    assert torch.equal(out["small"], torch.ones(3))


def test_shared_memory_threshold(arena: ShmArena, reader: ShmReader) -> None:
    below = torch.zeros(SHM_MIN_BYTES - 1, dtype=torch.uint8)
    at = torch.ones(SHM_MIN_BYTES, dtype=torch.uint8)
    enc = encode(_reply([below, at]), arena=arena)
    assert len(enc.frames) == 2  # ``below`` is a frame, ``at`` is in shared memory
    out = decode(enc.frames, reader=reader).body["result"]
    assert torch.equal(out[0], below)
    assert torch.equal(out[1], at)


def test_shared_memory_numpy_and_batch(arena: ShmArena, reader: ShmReader) -> None:
    a = np.arange(MIB // 2, dtype=np.float64)  # 4 MiB
    batch = TensorBatch({"x": torch.arange(MIB // 4, dtype=torch.int64).reshape(-1, 2)})
    enc = encode(_reply([a, batch]), arena=arena, readers=2)
    assert len(enc.frames) == 1
    out = decode(enc.frames, reader=reader, reader_index=1).body["result"]
    assert np.array_equal(out[0], a) and out[0].dtype == a.dtype
    assert out[1].equals(batch)


def test_shared_memory_without_reader_is_a_protocol_error(arena: ShmArena) -> None:
    t = torch.ones(MIB, dtype=torch.uint8)
    enc = encode(_reply(t), arena=arena)
    assert len(enc.frames) == 1
    with pytest.raises(ProtocolError, match="shared-memory"):
        decode(enc.frames)


def test_shared_memory_bad_reader_index_is_a_protocol_error(
    arena: ShmArena, reader: ShmReader
) -> None:
    enc = encode(_reply(torch.ones(MIB, dtype=torch.uint8)), arena=arena, readers=1)
    with pytest.raises(ProtocolError, match="descriptor"):
        decode(enc.frames, reader=reader, reader_index=3)


def test_shared_memory_descriptor_is_read_once(arena: ShmArena, reader: ShmReader) -> None:
    enc = encode(_reply(torch.ones(MIB, dtype=torch.uint8)), arena=arena, readers=1)
    first = decode(enc.frames, reader=reader).body["result"]
    assert first.sum().item() == MIB
    with pytest.raises(ProtocolError):
        decode(enc.frames, reader=reader)


def test_full_arena_falls_back_to_a_frame(shm_prefix: str, reader: ShmReader) -> None:
    with ShmArena(prefix=shm_prefix, max_bytes=MIB, min_segment_bytes=MIB) as small:
        t = torch.arange(MIB // 4, dtype=torch.int32)  # 1 MiB + a header page > max_bytes
        enc = encode(_reply(t), arena=small)
        assert len(enc.frames) == 2
        assert torch.equal(decode(enc.frames, reader=reader).body["result"], t)


def test_shared_memory_respects_max_frame_bytes(arena: ShmArena, reader: ShmReader) -> None:
    enc = encode(_reply(torch.ones(MIB, dtype=torch.uint8)), arena=arena)
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode(enc.frames, reader=reader, max_frame_bytes=1000)


# ---------------------------------------------------------------------------------- 7. malformed input
def _decode_or_protocol_error(frames: list[Any]) -> None:
    """Decoding must either give a Message or raise ProtocolError, nothing else."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, Message)
    assert isinstance(msg.type, MsgType)
    assert isinstance(msg.call_id, int)
    assert isinstance(msg.body, dict)


def test_empty_frame_list() -> None:
    with pytest.raises(ProtocolError, match="empty"):
        decode([])


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\xc1", b"\x94", b"\xdd\xff\xff\xff\xff", b"\x92\x01", b"\xa3ab", b"\x81\x90\x01"],
)
def test_garbage_header(garbage: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode([garbage])


def test_random_garbage_headers() -> None:
    rng = random.Random(20240611)
    for i in range(200):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 48)))
        if i % 2:  # start like a real header so the deeper checks are reached too
            blob = b"\x94\x01" + blob
        _decode_or_protocol_error([blob, bytearray(rng.randbytes(rng.randrange(0, 64)))])


def test_mutated_valid_messages() -> None:
    rng = random.Random(7)
    body = {"result": [torch.arange(300.0), torch.ones(3), np.arange(4), {"s": "t"}]}
    frames = [bytes(f) for f in encode(_reply(body)).frames]
    for _ in range(300):
        header = bytearray(frames[0])
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(header))
            roll = rng.random()
            if roll < 0.6:
                header[pos] = rng.randrange(256)
            elif roll < 0.8:
                del header[pos]
            else:
                header.insert(pos, rng.randrange(256))
        _decode_or_protocol_error([bytes(header), *frames[1:]])


@pytest.mark.parametrize(
    "header",
    [[1, 5, 1], [1, 5, 1, {}, 0], [], {"v": 1}, 5, "hello", None],
    ids=["3-list", "5-list", "empty", "map", "int", "str", "nil"],
)
def test_header_not_a_four_list(header: Any) -> None:
    with pytest.raises(ProtocolError, match="header"):
        decode([msgpack.packb(header)])


@pytest.mark.parametrize("version", [99, 0, "1", None, [1]])
def test_wrong_version(version: Any) -> None:
    frame = msgpack.packb([version, 4, 1, {"role": "r", "method": "m", "args": [], "kwargs": {}}])
    with pytest.raises(ProtocolError, match="version"):
        decode([frame])


@pytest.mark.parametrize(
    "version",
    [_tensor_ext("float32", [2], b"\0" * 8), _ndarray_ext("<f4", [2], b"\0" * 8)],
    ids=["tensor", "ndarray"],
)
def test_array_in_version_slot(version: Any) -> None:
    with pytest.raises(ProtocolError):
        decode([_header(version=version)])


@pytest.mark.parametrize("type_code", [42, 0, -1, "REPLY", None, 5.5])
def test_unknown_message_type(type_code: Any) -> None:
    with pytest.raises(ProtocolError, match="message type"):
        decode([_header(type_=type_code)])


@pytest.mark.parametrize("call_id", ["7", None, 1.5, [1], {"id": 1}])
def test_call_id_not_int(call_id: Any) -> None:
    with pytest.raises(ProtocolError, match="call id"):
        decode([_header(call_id=call_id)])


def test_valid_hand_built_header_decodes() -> None:
    msg = decode([_header(body={"result": [1, "a"]}, call_id=2**40)])
    assert msg == Message(MsgType.REPLY, 2**40, {"result": [1, "a"]})
    call = {"role": "actor", "method": "step", "args": [], "kwargs": {}}
    assert decode([_header(body=call, type_=4)]).body == call
    assert decode([_header(body={}, type_=8)]).type is MsgType.SHUTDOWN


@pytest.mark.parametrize(
    ("type_", "body", "missing"),
    [
        (4, {"role": "r", "args": [], "kwargs": {}}, "method"),
        (5, {}, "result"),
        (3, {"why": "x"}, "reason"),
        (6, {"role": "r", "rank": 0, "exc_type": "E", "message": "m"}, "traceback"),
    ],
)
def test_body_missing_required_keys(type_: int, body: dict[str, Any], missing: str) -> None:
    with pytest.raises(ProtocolError, match=missing):
        decode([_header(body=body, type_=type_)])


@pytest.mark.parametrize("body", [[1, 2], "body", 3, True])
def test_body_not_a_map(body: Any) -> None:
    with pytest.raises(ProtocolError, match="map"):
        decode([msgpack.packb([PROTOCOL_VERSION, 5, 1, body])])


@pytest.mark.parametrize("index", [0, 2, 5, -1, 1 << 40])
def test_tensor_frame_index_out_of_range(index: int) -> None:
    header = _header({"result": _tensor_ext("float32", [250], index)})
    with pytest.raises(ProtocolError, match="frame index"):
        decode([header, bytes(1000)])


def test_tensor_frame_index_must_be_int() -> None:
    for where in (True, 1.0, None, [1], "1"):
        with pytest.raises(ProtocolError, match="location"):
            decode([_header({"result": _tensor_ext("float32", [250], where)}), bytes(1000)])


def test_frames_referencing_ok_then_truncated() -> None:
    good = _header({"result": _tensor_ext("float32", [250], 1)})
    assert decode([good, bytearray(1000)]).body["result"].shape == (250,)
    for size in (999, 996, 0, 1004):
        with pytest.raises(ProtocolError, match="truncated"):
            decode([good, bytearray(size)])


@pytest.mark.parametrize("size", [7, 9, 0])
def test_inline_bytes_wrong_length(size: int) -> None:
    with pytest.raises(ProtocolError, match="bytes"):
        decode([_header({"result": _tensor_ext("float64", [1], b"\0" * size)})])


@pytest.mark.parametrize("dtype", ["float33", "qint8", "torch.float32", "", 5, None, b"float32"])
def test_unknown_tensor_dtype(dtype: Any) -> None:
    with pytest.raises(ProtocolError, match="dtype"):
        decode([_header({"result": _tensor_ext(dtype, [2], b"\0" * 8)})])


@pytest.mark.parametrize(
    "shape", [[-1], [2, -4], [True], [False, 2], [1.0], ["2"], None, 2, {"0": 2}]
)
def test_bad_tensor_shape(shape: Any) -> None:
    with pytest.raises(ProtocolError, match="shape"):
        decode([_header({"result": _tensor_ext("uint8", shape, b"\0\0")})])


def test_bad_ndarray_payloads() -> None:
    for dtype in ("zz9", 5, [1], "|O", "O"):
        with pytest.raises(ProtocolError, match=r"dtype|object"):
            decode([_header({"result": _ndarray_ext(dtype, [2], b"\0" * 16)})])
    with pytest.raises(ProtocolError, match="shape"):
        decode([_header({"result": _ndarray_ext("<f8", [-2], b"\0" * 16)})])
    with pytest.raises(ProtocolError, match="truncated"):
        decode([_header({"result": _ndarray_ext("<f8", [3], b"\0" * 16)})])


@pytest.mark.parametrize(
    "payload",
    [
        [{"x": 1}, {}, {}],  # tensor column that is not a tensor
        [{}, {"a": "not a list"}, {}],
        [{}, {"a": [1, 2], "b": [1]}, {}],  # row counts differ
        [{"x": _tensor_ext("float32", [], b"\0" * 4)}, {}, {}],  # 0-d column
        [{}, {}],  # two fields
        "batch",
    ],
)
def test_bad_tensor_batch(payload: Any) -> None:
    ext = msgpack.ExtType(EXT_BATCH, msgpack.packb(payload, use_bin_type=True))
    with pytest.raises(ProtocolError):
        decode([_header({"result": ext})])


def test_frame_bigger_than_max_frame_bytes() -> None:
    header = _header({"result": _tensor_ext("uint8", [2000], 1)})
    assert decode([header, bytearray(2000)], max_frame_bytes=2000).body["result"].numel() == 2000
    with pytest.raises(ProtocolError, match="limit"):
        decode([header, bytearray(2000)], max_frame_bytes=1000)
    # An unreferenced oversized frame is refused too.
    with pytest.raises(ProtocolError, match="limit"):
        decode([_header(), bytes(2000)], max_frame_bytes=1000)


def test_inline_tensor_bigger_than_max_frame_bytes() -> None:
    header = _header({"result": _tensor_ext("uint8", [300], b"\0" * 300)})
    assert decode([header], max_frame_bytes=300).body["result"].numel() == 300
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode([header], max_frame_bytes=100)


def test_huge_declared_shape_is_refused_before_allocating() -> None:
    header = _header({"result": _tensor_ext("float64", [1 << 30, 1 << 30], 1)})
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode([header, bytes(8)])


@pytest.mark.parametrize("code", [99, 0, 4, 127])
def test_unknown_ext_code(code: int) -> None:
    with pytest.raises(ProtocolError, match="extension"):
        decode([_header({"result": msgpack.ExtType(code, b"")})])


def test_malformed_ext_payloads() -> None:
    for data in (b"", b"\xc1", msgpack.packb(5), msgpack.packb([1, 2]), msgpack.packb([1] * 4)):
        for code in (EXT_TENSOR, EXT_NDARRAY, EXT_BATCH):
            with pytest.raises(ProtocolError):
                decode([_header({"result": msgpack.ExtType(code, data)})])


def test_shm_descriptor_garbage_with_reader(reader: ShmReader) -> None:
    for desc in (
        {},
        {"name": "../etc/passwd", "nbytes": 4, "gen": 1, "readers": 1},
        {"name": "hfnope-1-1", "nbytes": 4, "gen": 1, "readers": 1},
    ):
        with pytest.raises(ProtocolError, match="shared-memory"):
            decode([_header({"result": _tensor_ext("float32", [1], desc)})], reader=reader)


# ------------------------------------------------------------------------- lazy conj/neg views
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        lambda: torch.tensor(1 + 2j, dtype=torch.complex64).conj().imag,
    ],
    ids=["conj_view", "neg_view"],
)
def test_conjugate_and_negative_views_round_trip(make: Any) -> None:
    t = make()
    assert t.is_conj() or t.is_neg()
    out = _roundtrip(t)
    resolved = t.resolve_conj().resolve_neg()
    _assert_same(out, resolved)
    assert torch.equal(out, resolved)


def test_non_contiguous_conjugate_view_round_trips() -> None:
    # ``contiguous()`` copies these, which resolves the lazy bits; the codec resolves them itself.
    t = torch.tensor([[1 + 2j, 3 - 4j], [5 + 6j, -7j]], dtype=torch.complex64).conj().t()
    assert t.is_conj() and not t.is_contiguous()
    out = _roundtrip(t)
    assert torch.equal(out, t.resolve_conj())
    assert out[1, 0].item() == 3 + 4j
    assert out[0, 1].item() == 5 - 6j
    imag = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert imag.is_neg()
    assert _roundtrip(imag).tolist() == [-2.0, 4.0]


# ---------------------------------------------------------------------------------- 8. Layout
EXPECTED_2x2x2 = {
    0: (0, 0, 0),
    1: (0, 0, 1),
    2: (0, 1, 0),
    3: (0, 1, 1),
    4: (1, 0, 0),
    5: (1, 0, 1),
    6: (1, 1, 0),
    7: (1, 1, 1),
}


def test_layout_coords_and_rank_of_2x2x2() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.world_size == 8
    assert layout.coords(5) == (1, 0, 1)
    for rank, coords in EXPECTED_2x2x2.items():
        assert layout.coords(rank) == coords
        assert layout.rank_of(*coords) == rank


def test_layout_coords_uneven() -> None:
    layout = Layout(dp=3, tp=4, pp=2)  # tp fastest, then pp, then dp
    assert layout.world_size == 24
    assert layout.coords(0) == (0, 0, 0)
    assert layout.coords(3) == (0, 0, 3)
    assert layout.coords(4) == (0, 1, 0)
    assert layout.coords(8) == (1, 0, 0)
    assert layout.coords(23) == (2, 1, 3)
    assert layout.rank_of(dp=1, pp=1, tp=2) == 14
    seen = {layout.coords(r) for r in range(24)}
    assert len(seen) == 24
    assert all(layout.rank_of(*layout.coords(r)) == r for r in range(24))


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_layout_coords_out_of_range(rank: int) -> None:
    with pytest.raises(ValueError, match=str(rank)):
        Layout(dp=2, tp=2, pp=2).coords(rank)


@pytest.mark.parametrize("field", ["dp", "tp", "pp"])
@pytest.mark.parametrize("value", [0, -2, 1.0, "2", None])
def test_layout_rejects_bad_fields(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"layout.{field}=")):
        Layout(**{field: value})


def test_for_world() -> None:
    assert Layout.for_world(8, tp=2, pp=2) == Layout(dp=2, tp=2, pp=2)
    assert Layout.for_world(12, tp=4) == Layout(dp=3, tp=4, pp=1)
    assert Layout.for_world(6) == Layout(dp=6)
    with pytest.raises(ValueError) as info:
        Layout.for_world(6, tp=4)
    assert "tp=4" in str(info.value)
    assert "pp=1" in str(info.value)
    assert "world_size=6" in str(info.value)
    with pytest.raises(ValueError) as info:
        Layout.for_world(10, tp=2, pp=3)
    assert "tp=2" in str(info.value) and "pp=3" in str(info.value) and "10" in str(info.value)
    with pytest.raises(ValueError, match=re.escape("world_size=0")):
        Layout.for_world(0)


def test_for_world_zero_tp_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tp=0"):
        Layout.for_world(8, tp=0)


def test_layout_wire_round_trip() -> None:
    layout = Layout(dp=2, tp=4, pp=3)
    assert layout.to_wire() == {"dp": 2, "tp": 4, "pp": 3}
    assert Layout.from_wire(layout.to_wire()) == layout
    assert Layout.from_wire({"dp": 1, "tp": 1, "pp": 1, "extra": 9}) == Layout()
    msg = decode(encode(_reply(layout.to_wire())).frames)
    assert Layout.from_wire(msg.body["result"]) == layout


@pytest.mark.parametrize(
    "data",
    [
        None,
        [2, 2, 2],
        "dp=2",
        {},
        {"dp": 2, "tp": 2},
        {"dp": 0, "tp": 1, "pp": 1},
        {"dp": 1, "tp": -1, "pp": 1},
        {"dp": 1, "tp": 1, "pp": "2"},
        {"dp": 1.5, "tp": 1, "pp": 1},
        {"dp": None, "tp": 1, "pp": 1},
    ],
)
def test_layout_from_wire_rejects_bad_maps(data: Any) -> None:
    with pytest.raises(ProtocolError, match="layout"):
        Layout.from_wire(data)
