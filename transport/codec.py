"""msgpack codec with tensors as out-of-band frames — no pickle ever crosses a process boundary.

``encode`` turns a ``Message`` into ZeroMQ frames: frame 0 is the msgpack header, and each tensor
or numpy array in the body becomes a msgpack extension holding ``(dtype, shape, where)``. ``where``
is one of

- an ``int``: the index of a frame holding the raw bytes (sent zero-copy by ZeroMQ);
- ``bytes``: the raw bytes inline, for tensors under ``inline_bytes`` (a frame costs more than it
  saves for a handful of numbers);
- a ``dict``: a shared-memory descriptor (``transport.shm``), for big tensors between processes on
  one host when the link has an arena.

Settings and descriptions travel as typed structs (``transport/structs.py``): each type in
``STRUCTS`` becomes an extension holding ``[tag, fields]`` and is rebuilt, every field validated,
on receipt; an unknown tag is refused like an unknown extension, and an object of any other type
(a model or dataclass not in the table included) is refused when sending.

``decode`` rebuilds tensors zero-copy over the received frames (``torch.frombuffer``), validates
every index and size against the frames actually received, and raises ``ProtocolError`` for
anything malformed so the receiver can log it and carry on. ``HeaderLimits`` bounds what a header
may make the receiver build (bytes, entries of one array or map, one string, extension payloads):
a peer that has not proved who it is gets small ones, because one byte of msgpack can become a
72-byte Python object. Extensions nest at most ``MAX_EXT_DEPTH`` deep for everyone: each level
runs the C unpacker again on the stack, and a few hundred levels crash the process. Non-contiguous tensors are made
contiguous; 0-d, empty and every non-quantized dtype (bf16, fp8, complex, bool, ...) round-trip.
Tuples arrive as lists (msgpack has one array type).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from transport.agent import (
    AgentAsk,
    AgentEnd,
    AgentExchange,
    AgentReply,
    EnvAction,
    EnvOpen,
    EnvResult,
    EnvSpec,
)
from transport.batch import TensorBatch
from transport.device import in_host_memory
from transport.protocol import PROTOCOL_VERSION, Message, MsgType, ProtocolError, check_body
from transport.sampling import SamplingConfig
from transport.shm import ShmArena, ShmReader
from transport.structs import StructError, from_map, to_map
from transport.training import AdamStep, OptimConfig, PolicyLossConfig, ValueLossConfig
from transport.turns import TurnRequest, TurnResult
from transport.weight_sync import (
    Source,
    Target,
    WeightsReceived,
    WeightsSent,
    WeightSyncSettings,
)

EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_BATCH = 3
EXT_STRUCT = 4

#: tag on the wire → the struct type it names: the only structs a message may carry
STRUCTS: dict[str, type] = {
    "sampling": SamplingConfig,
    "policy_loss": PolicyLossConfig,
    "value_loss": ValueLossConfig,
    "optim": OptimConfig,
    "adam_step": AdamStep,
    "weight_sync": WeightSyncSettings,
    "weight_source": Source,
    "weight_target": Target,
    "weights_sent": WeightsSent,
    "weights_received": WeightsReceived,
    "env_spec": EnvSpec,
    "env_open": EnvOpen,
    "env_action": EnvAction,
    "env_result": EnvResult,
    "agent_ask": AgentAsk,
    "agent_reply": AgentReply,
    "agent_end": AgentEnd,
    "agent_exchange": AgentExchange,
    "turn_request": TurnRequest,
    "turn_result": TurnResult,
}
_TAGS = {cls: tag for tag, cls in STRUCTS.items()}

INLINE_BYTES = 512  # tensors smaller than this travel inside the header
SHM_MIN_BYTES = 1 << 20  # tensors at least this big use shared memory when the link has an arena
MAX_HEADER_BYTES = 64 << 20
MAX_EXT_DEPTH = 16  # a TensorBatch of tensors nests 2 deep; ~500 levels overflow the C stack

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and "qint" not in str(d) and "quint" not in str(d)
}


@dataclass(frozen=True)
class HeaderLimits:
    """What one header may make the receiver build. ``-1``: msgpack's own bound (the header's
    length). ``ext_bytes=0`` refuses tensors, arrays, batches and structs altogether."""

    header_bytes: int = MAX_HEADER_BYTES
    entries: int = -1  # entries of one array or map
    str_bytes: int = -1  # one str or bin
    ext_bytes: int = -1  # one tensor, array, batch or struct payload


DEFAULT_LIMITS = HeaderLimits()


@dataclass
class Encoded:
    frames: list[Any]  # header bytes, then buffers (numpy uint8 arrays over tensor memory)
    big: bool  # True when a frame is large enough for ZeroMQ to send it zero-copy (track it)

    @property
    def nbytes(self) -> int:
        return sum(len(f) if isinstance(f, bytes) else f.nbytes for f in self.frames)


class _Encoder:
    def __init__(self, arena: ShmArena | None, readers: int, inline_bytes: int) -> None:
        self.frames: list[Any] = [b""]
        self.arena = arena
        self.readers = readers
        self.inline_bytes = inline_bytes

    def default(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return msgpack.ExtType(EXT_TENSOR, self._pack_tensor(obj))
        if isinstance(obj, TensorBatch):
            return msgpack.ExtType(EXT_BATCH, self.pack([obj.tensors, obj.non_tensors, obj.meta]))
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("numpy object arrays cannot travel on the wire; use a list")
            flat = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
            return msgpack.ExtType(
                EXT_NDARRAY, self.pack([obj.dtype.str, list(obj.shape), self._place(flat)])
            )
        if isinstance(obj, np.generic):
            return obj.item()
        tag = _TAGS.get(type(obj))
        if tag is not None:
            return msgpack.ExtType(EXT_STRUCT, self.pack([tag, to_map(obj)]))
        raise TypeError(
            f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} over the wire: "
            "messages carry msgpack types, tensors, numpy arrays, TensorBatch and the structs "
            "of transport.codec.STRUCTS only (no pickle)"
        )

    def pack(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self.default, use_bin_type=True)

    def _pack_tensor(self, t: torch.Tensor) -> bytes:
        if t.is_quantized:
            raise TypeError("quantized tensors cannot travel on the wire; dequantize them first")
        if not in_host_memory(t):
            t = t.cpu()
        t = t.detach().resolve_conj().resolve_neg()
        if t.dtype.itemsize == 1 and t.dtype != torch.uint8:
            t = (
                t.view(torch.uint8).contiguous().view(t.dtype)
            )  # sub-byte dtypes have no copy kernel
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        return self.pack([str(t.dtype).removeprefix("torch."), list(t.shape), self._place(raw)])

    def _place(self, raw: torch.Tensor) -> Any:
        """Where a flat uint8 tensor's bytes travel: inline, a frame, or shared memory."""
        nbytes = raw.numel()
        if nbytes < self.inline_bytes:
            return raw.numpy().tobytes()
        if self.arena is not None and nbytes >= SHM_MIN_BYTES:
            desc = self.arena.put(raw, readers=self.readers)
            if desc is not None:
                return desc
        self.frames.append(raw.numpy())
        return len(self.frames) - 1


def encode(
    msg: Message,
    arena: ShmArena | None = None,
    readers: int = 1,
    inline_bytes: int = INLINE_BYTES,
) -> Encoded:
    """Frames for ``msg``. With an ``arena``, big tensors go through shared memory for
    ``readers`` receivers (same host only: the caller decides)."""
    enc = _Encoder(arena, readers, inline_bytes)
    enc.frames[0] = enc.pack([PROTOCOL_VERSION, int(msg.type), msg.call_id, msg.body])
    big = any(not isinstance(f, bytes) and f.nbytes >= 65536 for f in enc.frames[1:])
    return Encoded(enc.frames, big)


def frame_buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


class _Decoder:
    def __init__(
        self,
        frames: Sequence[Any],
        reader: ShmReader | None,
        reader_index: int,
        max_bytes: int,
        limits: HeaderLimits,
    ) -> None:
        self.frames = frames
        self.reader = reader
        self.reader_index = reader_index
        self.max_bytes = max_bytes
        self.limits = limits
        self.depth = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if self.depth >= MAX_EXT_DEPTH:
            raise ProtocolError(f"extensions nested deeper than {MAX_EXT_DEPTH}")
        self.depth += 1
        try:
            return self._ext(code, data)
        finally:
            self.depth -= 1

    def _ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            dtype_name, shape, where = self.unpack(data)
            dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None:
                raise ProtocolError(f"unknown tensor dtype {dtype_name!r}")
            shape = _check_shape(shape)
            raw = self._bytes(where, math.prod(shape) * dtype.itemsize)
            return raw.view(dtype).reshape(shape)
        if code == EXT_NDARRAY:
            dtype_str, shape, where = self.unpack(data)
            try:
                if not isinstance(dtype_str, str):
                    raise TypeError(dtype_str)
                np_dtype = np.dtype(dtype_str)
            except TypeError as exc:
                raise ProtocolError(f"unknown numpy dtype {dtype_str!r}") from exc
            if np_dtype.hasobject:
                raise ProtocolError("numpy object arrays are not accepted")
            shape = _check_shape(shape)
            raw = self._bytes(where, math.prod(shape) * np_dtype.itemsize)
            return raw.numpy().view(np_dtype).reshape(shape)
        if code == EXT_BATCH:
            tensors, non_tensors, meta = self.unpack(data)
            try:
                return TensorBatch(tensors=tensors, non_tensors=non_tensors, meta=meta)
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"bad TensorBatch: {exc}") from exc
        if code == EXT_STRUCT:
            return self._struct(self.unpack(data))
        raise ProtocolError(f"unknown msgpack extension type {code}")

    def _struct(self, payload: Any) -> Any:
        if not isinstance(payload, list) or len(payload) != 2:
            raise ProtocolError("a struct must be [tag, fields]")
        tag, fields = payload
        cls = STRUCTS.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ProtocolError(f"unknown struct type {tag!r}; known: {sorted(STRUCTS)}")
        if not isinstance(fields, dict):
            raise ProtocolError(f"struct {tag!r} fields must be a map, got {type(fields).__name__}")
        try:
            return from_map(cls, fields)
        except StructError as exc:
            raise ProtocolError(f"struct {tag!r}: {exc}") from exc

    def unpack(self, data: bytes | memoryview) -> Any:
        limits = self.limits
        return msgpack.unpackb(
            data,
            ext_hook=self.ext_hook,
            raw=False,
            strict_map_key=False,
            use_list=True,
            max_str_len=limits.str_bytes,
            max_bin_len=limits.str_bytes,
            max_array_len=limits.entries,
            max_map_len=limits.entries,
            max_ext_len=limits.ext_bytes,
        )

    def _bytes(self, where: Any, nbytes: int) -> torch.Tensor:
        if nbytes > self.max_bytes:
            raise ProtocolError(
                f"tensor of {nbytes} bytes exceeds max_frame_bytes={self.max_bytes}"
            )
        if isinstance(where, bytes):
            raw = torch.frombuffer(bytearray(where), dtype=torch.uint8) if where else _empty()
        elif isinstance(where, int) and not isinstance(where, bool):
            if not 1 <= where < len(self.frames):
                raise ProtocolError(f"tensor frame index {where} but {len(self.frames)} frames")
            buf = frame_buffer(self.frames[where])
            raw = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else _empty()
        elif isinstance(where, dict):
            if self.reader is None:
                raise ProtocolError("shared-memory tensor on a link without shared memory")
            try:
                raw = self.reader.get(where, self.reader_index)
            except ValueError as exc:
                raise ProtocolError(f"bad shared-memory descriptor: {exc}") from exc
        else:
            raise ProtocolError(f"bad tensor location {type(where).__name__}")
        if raw.numel() != nbytes:
            raise ProtocolError(
                f"tensor needs {nbytes} bytes, frame has {raw.numel()} (truncated?)"
            )
        return raw


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _check_shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ProtocolError(f"bad tensor shape {shape!r}")
    return shape


def decode(
    frames: Sequence[Any],
    reader: ShmReader | None = None,
    reader_index: int = 0,
    max_frame_bytes: int = 1 << 40,
    limits: HeaderLimits = DEFAULT_LIMITS,
) -> Message:
    """Rebuild a message from received frames (``zmq.Frame`` or bytes-like). Raises
    ``ProtocolError`` with the reason for anything malformed or over ``limits``."""
    if not frames:
        raise ProtocolError("empty message")
    for i, frame in enumerate(frames):
        size = frame_buffer(frame).nbytes
        limit = limits.header_bytes if i == 0 else max_frame_bytes
        if size > limit:
            raise ProtocolError(f"frame {i} has {size} bytes, over the limit of {limit}")
    dec = _Decoder(frames, reader, reader_index, max_frame_bytes, limits)
    try:
        header = dec.unpack(frame_buffer(frames[0]))
    except ProtocolError:
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # msgpack names the limit: "9 exceeds max_map_len(8)"
            raise ProtocolError(f"header is over a decode limit ({exc})") from exc
        raise ProtocolError(f"header is not valid msgpack (ValueError: {exc})") from exc
    except Exception as exc:  # msgpack raises many types for garbage; all mean "not ours"
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(header, list) or len(header) != 4:
        raise ProtocolError("header must be [version, type, call_id, body]")
    version, type_code, call_id, body = header
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    try:
        if type(type_code) is not int:
            raise ValueError(type_code)
        msg_type = MsgType(type_code)
    except ValueError as exc:
        raise ProtocolError(f"unknown message type {type_code!r}") from exc
    if type(call_id) is not int:
        raise ProtocolError(f"call id must be an integer, got {type(call_id).__name__}")
    return Message(msg_type, call_id, check_body(msg_type, body))
