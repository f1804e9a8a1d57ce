"""Decode limits: what one header may make a receiver build, and how deep extensions may nest.

A peer that has not proved who it is gets small ``HeaderLimits`` (the controller's
``UNREGISTERED_LIMITS``); everyone gets the nesting bound, because each extension level runs
msgpack's C unpacker again on the stack and about 500 levels crashed the process (SIGSEGV).
"""

from __future__ import annotations

import msgpack
import pytest
import torch

from transport.codec import EXT_BATCH, MAX_EXT_DEPTH, HeaderLimits, decode, encode
from transport.protocol import PROTOCOL_VERSION, Message, MsgType, ProtocolError

SMALL = HeaderLimits(header_bytes=1024, entries=8, str_bytes=16, ext_bytes=0)


def _reply(result: object) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, int(MsgType.REPLY), 1, {"result": result}])


def _nested_batches(depth: int) -> bytes:
    inner = msgpack.packb([{}, {}, {}])
    for _ in range(depth - 1):  # a batch whose meta holds the next batch
        inner = msgpack.packb([{}, {}, {"b": msgpack.ExtType(EXT_BATCH, inner)}])
    return _reply(msgpack.ExtType(EXT_BATCH, inner))


def test_extensions_nested_too_deep_are_refused_not_a_crash() -> None:
    with pytest.raises(ProtocolError, match=f"nested deeper than {MAX_EXT_DEPTH}"):
        decode([_nested_batches(2000)])


def test_nesting_within_the_bound_decodes() -> None:
    msg = decode([_nested_batches(MAX_EXT_DEPTH)])
    assert msg.body["result"].meta["b"].meta["b"] is not None


@pytest.mark.parametrize(
    ("result", "limit"),
    [
        ([0] * 9, "max_array_len"),
        ({str(i): i for i in range(9)}, "max_map_len"),
        ("x" * 17, "max_str_len"),
        (b"x" * 17, "max_bin_len"),
    ],
)
def test_header_limits_name_the_limit(result: object, limit: str) -> None:
    with pytest.raises(ProtocolError, match=f"over a decode limit.*{limit}"):
        decode([_reply(result)], limits=SMALL)
    assert decode([_reply(result)]).body["result"] == result  # the defaults let it through


def test_header_limits_can_refuse_every_tensor() -> None:
    frames = encode(Message(MsgType.REPLY, 1, {"result": torch.ones(2)})).frames
    with pytest.raises(ProtocolError, match="max_ext_len"):
        decode(frames, limits=SMALL)


def test_header_over_its_byte_limit_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match=r"frame 0 has .* over the limit of 1024"):
        decode([_reply("x" * 2000)], limits=SMALL)


def test_empty_maps_header_is_refused_by_its_entry_count() -> None:
    n = 1 << 20
    array = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    header = bytes([0x94, PROTOCOL_VERSION, int(MsgType.HELLO), 0]) + array
    with pytest.raises(ProtocolError, match="max_array_len"):
        decode([header], limits=HeaderLimits(entries=256))
