"""transport.codec refuses malformed input with ProtocolError; protocol.Layout validates."""

from __future__ import annotations

import random
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tests.transport.codec_helpers import (
    make_header,
    ndarray_ext,
    reply,
    tensor_ext,
)
from transport.codec import EXT_BATCH, EXT_NDARRAY, EXT_STRUCT, EXT_TENSOR, decode, encode
from transport.protocol import PROTOCOL_VERSION, Layout, Message, MsgType, ProtocolError
from transport.shm import ShmReader


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
def test_garbagemake_header(garbage: bytes) -> None:
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
    frames = [bytes(f) for f in encode(reply(body)).frames]
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
    [tensor_ext("float32", [2], b"\0" * 8), ndarray_ext("<f4", [2], b"\0" * 8)],
    ids=["tensor", "ndarray"],
)
def test_array_in_version_slot(version: Any) -> None:
    with pytest.raises(ProtocolError):
        decode([make_header(version=version)])


@pytest.mark.parametrize("type_code", [42, 0, -1, "REPLY", None, 5.5])
def test_unknown_message_type(type_code: Any) -> None:
    with pytest.raises(ProtocolError, match="message type"):
        decode([make_header(type_=type_code)])


@pytest.mark.parametrize("call_id", ["7", None, 1.5, [1], {"id": 1}])
def test_call_id_not_int(call_id: Any) -> None:
    with pytest.raises(ProtocolError, match="call id"):
        decode([make_header(call_id=call_id)])


def test_valid_hand_built_header_decodes() -> None:
    msg = decode([make_header(body={"result": [1, "a"]}, call_id=2**40)])
    assert msg == Message(MsgType.REPLY, 2**40, {"result": [1, "a"]})
    call = {"role": "actor", "method": "step", "args": [], "kwargs": {}}
    assert decode([make_header(body=call, type_=4)]).body == call
    assert decode([make_header(body={}, type_=8)]).type is MsgType.SHUTDOWN


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
        decode([make_header(body=body, type_=type_)])


@pytest.mark.parametrize("body", [[1, 2], "body", 3, True])
def test_body_not_a_map(body: Any) -> None:
    with pytest.raises(ProtocolError, match="map"):
        decode([msgpack.packb([PROTOCOL_VERSION, 5, 1, body])])


@pytest.mark.parametrize("index", [0, 2, 5, -1, 1 << 40])
def test_tensor_frame_index_out_of_range(index: int) -> None:
    header = make_header({"result": tensor_ext("float32", [250], index)})
    with pytest.raises(ProtocolError, match="frame index"):
        decode([header, bytes(1000)])


def test_tensor_frame_index_must_be_int() -> None:
    for where in (True, 1.0, None, [1], "1"):
        with pytest.raises(ProtocolError, match="location"):
            decode([make_header({"result": tensor_ext("float32", [250], where)}), bytes(1000)])


def test_frames_referencing_ok_then_truncated() -> None:
    good = make_header({"result": tensor_ext("float32", [250], 1)})
    assert decode([good, bytearray(1000)]).body["result"].shape == (250,)
    for size in (999, 996, 0, 1004):
        with pytest.raises(ProtocolError, match="truncated"):
            decode([good, bytearray(size)])


@pytest.mark.parametrize("size", [7, 9, 0])
def test_inline_bytes_wrong_length(size: int) -> None:
    with pytest.raises(ProtocolError, match="bytes"):
        decode([make_header({"result": tensor_ext("float64", [1], b"\0" * size)})])


@pytest.mark.parametrize("dtype", ["float33", "qint8", "torch.float32", "", 5, None, b"float32"])
def test_unknown_tensor_dtype(dtype: Any) -> None:
    with pytest.raises(ProtocolError, match="dtype"):
        decode([make_header({"result": tensor_ext(dtype, [2], b"\0" * 8)})])


@pytest.mark.parametrize(
    "shape", [[-1], [2, -4], [True], [False, 2], [1.0], ["2"], None, 2, {"0": 2}]
)
def test_bad_tensor_shape(shape: Any) -> None:
    with pytest.raises(ProtocolError, match="shape"):
        decode([make_header({"result": tensor_ext("uint8", shape, b"\0\0")})])


def test_bad_ndarray_payloads() -> None:
    for dtype in ("zz9", 5, [1], "|O", "O"):
        with pytest.raises(ProtocolError, match=r"dtype|object"):
            decode([make_header({"result": ndarray_ext(dtype, [2], b"\0" * 16)})])
    with pytest.raises(ProtocolError, match="shape"):
        decode([make_header({"result": ndarray_ext("<f8", [-2], b"\0" * 16)})])
    with pytest.raises(ProtocolError, match="truncated"):
        decode([make_header({"result": ndarray_ext("<f8", [3], b"\0" * 16)})])


@pytest.mark.parametrize(
    "payload",
    [
        [{"x": 1}, {}, {}],  # tensor column that is not a tensor
        [{}, {"a": "not a list"}, {}],
        [{}, {"a": [1, 2], "b": [1]}, {}],  # row counts differ
        [{"x": tensor_ext("float32", [], b"\0" * 4)}, {}, {}],  # 0-d column
        [{}, {}],  # two fields
        "batch",
    ],
)
def test_bad_tensor_batch(payload: Any) -> None:
    ext = msgpack.ExtType(EXT_BATCH, msgpack.packb(payload, use_bin_type=True))
    with pytest.raises(ProtocolError):
        decode([make_header({"result": ext})])


def test_frame_bigger_than_max_frame_bytes() -> None:
    header = make_header({"result": tensor_ext("uint8", [2000], 1)})
    assert decode([header, bytearray(2000)], max_frame_bytes=2000).body["result"].numel() == 2000
    with pytest.raises(ProtocolError, match="limit"):
        decode([header, bytearray(2000)], max_frame_bytes=1000)
    # An unreferenced oversized frame is refused too.
    with pytest.raises(ProtocolError, match="limit"):
        decode([make_header(), bytes(2000)], max_frame_bytes=1000)


def test_inline_tensor_bigger_than_max_frame_bytes() -> None:
    header = make_header({"result": tensor_ext("uint8", [300], b"\0" * 300)})
    assert decode([header], max_frame_bytes=300).body["result"].numel() == 300
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode([header], max_frame_bytes=100)


def test_huge_declared_shape_is_refused_before_allocating() -> None:
    header = make_header({"result": tensor_ext("float64", [1 << 30, 1 << 30], 1)})
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode([header, bytes(8)])


@pytest.mark.parametrize("code", [99, 0, 5, 127])
def test_unknown_ext_code(code: int) -> None:
    with pytest.raises(ProtocolError, match="extension"):
        decode([make_header({"result": msgpack.ExtType(code, b"")})])


def test_malformed_ext_payloads() -> None:
    for data in (b"", b"\xc1", msgpack.packb(5), msgpack.packb([1, 2]), msgpack.packb([1] * 4)):
        for code in (EXT_TENSOR, EXT_NDARRAY, EXT_BATCH, EXT_STRUCT):
            with pytest.raises(ProtocolError):
                decode([make_header({"result": msgpack.ExtType(code, data)})])


def test_shm_descriptor_garbage_with_reader(reader: ShmReader) -> None:
    for desc in (
        {},
        {"name": "../etc/passwd", "nbytes": 4, "gen": 1, "readers": 1},
        {"name": "hfnope-1-1", "nbytes": 4, "gen": 1, "readers": 1},
    ):
        with pytest.raises(ProtocolError, match="shared-memory"):
            decode([make_header({"result": tensor_ext("float32", [1], desc)})], reader=reader)


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
    assert layout.to_wire() == {"dp": 2, "tp": 4, "pp": 3, "gen_tp": 0, "gen_pp": 0}
    assert Layout.from_wire(layout.to_wire()) == layout
    assert Layout.from_wire({"dp": 1, "tp": 1, "pp": 1, "extra": 9}) == Layout()
    msg = decode(encode(reply(layout.to_wire())).frames)
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
        {"dp": True, "tp": 1, "pp": 1},
        {"dp": 2.0, "tp": 1, "pp": 1},
        {"dp": 1, "tp": 2, "pp": 1, "gen_tp": 3},
    ],
)
def test_layout_from_wire_rejects_bad_maps(data: Any) -> None:
    with pytest.raises(ProtocolError, match="layout"):
        Layout.from_wire(data)
