"""Helpers shared by the codec tests: round trips, random tensors of any dtype, hand-built
headers and extension payloads."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

from transport.codec import EXT_NDARRAY, EXT_TENSOR, decode, encode
from transport.protocol import PROTOCOL_VERSION, Message, MsgType


def reply(x: Any) -> Message:
    return Message(MsgType.REPLY, 7, {"result": x})


def roundtrip(x: Any) -> Any:
    msg = decode(encode(reply(x)).frames)
    assert msg.type is MsgType.REPLY
    assert msg.call_id == 7
    return msg.body["result"]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (works for fp8, uint1, bits16, ...)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    high = 2 if dtype == torch.bool else 256  # only 0/1 are valid bool bytes
    raw = torch.randint(0, high, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor."""
    assert t.is_contiguous()
    return t.reshape(-1).view(torch.uint8)


def assert_same(out: Any, ref: torch.Tensor) -> None:
    assert isinstance(out, torch.Tensor)
    assert out.dtype == ref.dtype
    assert tuple(out.shape) == tuple(ref.shape)
    assert torch.equal(raw_bytes(out.contiguous()), raw_bytes(ref))


def tensor_ext(dtype: Any, shape: Any, where: Any) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([dtype, shape, where], use_bin_type=True))


def ndarray_ext(dtype: Any, shape: Any, where: Any) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([dtype, shape, where], use_bin_type=True))


def make_header(
    body: Any = None, version: Any = PROTOCOL_VERSION, type_: Any = 5, call_id: Any = 1
) -> bytes:
    if body is None:
        body = {"result": None}
    return msgpack.packb([version, type_, call_id, body], use_bin_type=True)
