"""transport.codec round trips: every dtype, odd shapes, frame counts, aliasing, shared memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.transport.codec_helpers import (
    assert_same,
    random_tensor,
    raw_bytes,
    reply,
    roundtrip,
)
from transport import codec
from transport.batch import TensorBatch
from transport.codec import (
    INLINE_BYTES,
    SHM_MIN_BYTES,
    Encoded,
    decode,
    encode,
)
from transport.protocol import Layout, ProtocolError
from transport.shm import ShmArena, ShmReader

MIB = 1 << 20
ALL_DTYPES = sorted(codec._DTYPES)
# Dtypes narrower than a byte: torch has no copy kernel for them; the codec copies them as bytes.
SUB_BYTE = {f"{kind}{bits}" for kind in ("uint", "int") for bits in range(1, 8)}


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
    t = random_tensor(dtype, (3, elements // 3), seed=elements)
    enc = encode(reply(t))
    nbytes = t.numel() * dtype.itemsize
    assert len(enc.frames) == (1 if nbytes < INLINE_BYTES else 2)
    assert_same(decode(enc.frames).body["result"], t)


def test_bfloat16_values_round_trip() -> None:
    t = torch.tensor([1.5, -2.25, 0.0, 3.0e38, float("inf")], dtype=torch.bfloat16)
    out = roundtrip(t)
    assert_same(out, t)
    assert out.tolist() == t.tolist()
    big = torch.randn(1024, 3).to(torch.bfloat16)
    assert_same(roundtrip(big), big)


@pytest.mark.parametrize("dtype_name", ["float32", "int64", "complex128", "float16", "bool"])
def test_zero_d_scalar_keeps_its_shape(dtype_name: str) -> None:
    t = random_tensor(codec._DTYPES[dtype_name], (), seed=3)
    out = roundtrip(t)
    assert out.ndim == 0
    assert_same(out, t)


# ---------------------------------------------------------------------------------- 2. shapes
def _frames_for(x: Any) -> int:
    """Frames added on top of the header."""
    return len(encode(reply(x)).frames) - 1


def test_non_contiguous_tensors_round_trip() -> None:
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    for t in (base.t(), base[:, ::3], base[::2, 1::4], base.t()[3:9]):
        assert not t.is_contiguous()
        out = roundtrip(t)
        assert out.is_contiguous()
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out, t)
    big = torch.arange(64 * 64, dtype=torch.int64).reshape(64, 64).t()
    assert _frames_for(big) == 1
    assert torch.equal(roundtrip(big), big)


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
@pytest.mark.parametrize("layout", ["slice_small", "transposed_big"])
def test_non_contiguous_every_dtype(dtype_name: str, layout: str, request: Any) -> None:
    dtype = codec._DTYPES[dtype_name]
    if layout == "slice_small":
        full = random_tensor(dtype, (8, 12), seed=5)
        t = full[:, ::3]
    else:
        full = random_tensor(dtype, (64, 64), seed=6)  # square: torch's transpose-copy path
        t = full.t()
    assert not t.is_contiguous()
    # Expected bytes built without a copy kernel: gather the uint8 view (same itemsize) instead.
    ref_bytes = full.view(torch.uint8) if dtype.itemsize == 1 else None
    out = roundtrip(t)
    assert out.dtype == dtype and out.shape == t.shape
    if ref_bytes is not None:
        expect = ref_bytes[:, ::3] if layout == "slice_small" else ref_bytes.t()
        assert torch.equal(raw_bytes(out).reshape(expect.shape), expect.contiguous())
    else:
        assert torch.equal(raw_bytes(out), raw_bytes(t.contiguous()))


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 100000)])
def test_empty_tensors_round_trip_and_add_no_frame(shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=torch.float64)
    assert _frames_for(t) == 0
    out = roundtrip(t)
    assert out.dtype == torch.float64
    assert tuple(out.shape) == shape
    assert out.numel() == 0


def test_one_element_and_scalar_stay_distinct() -> None:
    one = torch.tensor([2.5])
    scalar = torch.tensor(2.5)
    out_one, out_scalar = roundtrip([one, scalar])
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
    enc = encode(reply(body))
    assert len(enc.frames) == 1 + 3
    out = decode(enc.frames).body["result"]
    assert torch.equal(out["a"], big[0])
    assert torch.equal(out["b"][1], big[1])
    assert torch.equal(out["b"][2]["c"], big[2])
    assert torch.equal(out["b"][0], small[0])
    assert out["e"].shape == (0,)


def test_big_flag_only_for_frames_of_64k_or_more() -> None:
    assert encode(reply(torch.ones(4))).big is False
    assert encode(reply(torch.zeros(65535, dtype=torch.uint8))).big is False
    assert encode(reply(torch.zeros(65536, dtype=torch.uint8))).big is True
    mixed = [torch.zeros(1000, dtype=torch.uint8), torch.zeros(70000, dtype=torch.uint8)]
    assert encode(reply(mixed)).big is True
    # A header over 64 KiB (inline bytes, long strings) is not a tracked frame.
    assert encode(reply("x" * 100_000)).big is False


def test_encoded_nbytes_counts_all_frames() -> None:
    t = torch.zeros(1000, dtype=torch.float32)
    enc = encode(reply(t))
    assert isinstance(enc, Encoded)
    assert enc.nbytes == len(enc.frames[0]) + 4000


# ---------------------------------------------------------------------------------- 3/4. aliasing
def test_receive_is_zero_copy_over_writable_frames() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    enc = encode(reply(t))
    frames: list[Any] = [enc.frames[0]] + [bytearray(f.tobytes()) for f in enc.frames[1:]]
    out = decode(frames).body["result"]
    assert torch.equal(out, t)
    frames[1][0:4] = (123456).to_bytes(4, "little")
    assert out[0].item() == 123456
    out[1] = -5
    assert int.from_bytes(frames[1][4:8], "little", signed=True) == -5


def test_numpy_receive_is_zero_copy_over_writable_frames() -> None:
    a = np.arange(500, dtype=np.float64)
    enc = encode(reply(a))
    frames: list[Any] = [enc.frames[0], bytearray(enc.frames[1].tobytes())]
    out = decode(frames).body["result"]
    frames[1][0:8] = np.float64(7.5).tobytes()
    assert out[0] == 7.5


def test_frames_are_zero_copy_views_of_the_senders_tensor() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    enc = encode(reply(t))
    assert np.shares_memory(enc.frames[1], t.numpy())


def test_inline_bytes_do_not_alias_the_senders_tensor() -> None:
    t = torch.arange(10, dtype=torch.float32)
    expect = t.clone()
    enc = encode(reply(t))
    t.add_(100)
    assert torch.equal(decode(enc.frames).body["result"], expect)


def test_inline_decoded_tensors_do_not_alias_each_other() -> None:
    enc = encode(reply(torch.ones(4)))
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
    out = roundtrip(array)
    assert isinstance(out, np.ndarray)
    assert out.dtype == array.dtype
    assert out.shape == array.shape
    assert np.array_equal(out, array)


def test_numpy_scalars_become_python_values() -> None:
    out = roundtrip([np.float32(1.5), np.int64(-3), np.bool_(True)])
    assert out == [1.5, -3, True]
    assert [type(v) for v in out] == [float, int, bool]


def test_numpy_object_array_is_refused() -> None:
    with pytest.raises(TypeError, match="object"):
        encode(reply(np.array([1, "a", None], dtype=object)))


@pytest.mark.parametrize("obj", [object(), {1, 2}, frozenset(), complex(1, 2), Layout()], ids=type)
def test_unknown_objects_are_refused_without_pickle(obj: Any) -> None:
    with pytest.raises(TypeError, match="no pickle"):
        encode(reply(obj))
    with pytest.raises(TypeError, match="no pickle"):
        encode(reply({"nested": [1, obj]}))


def test_quantized_tensor_is_refused() -> None:
    q = torch.quantize_per_tensor(torch.randn(4), scale=0.1, zero_point=0, dtype=torch.qint8)
    with pytest.raises(TypeError, match="quantized"):
        encode(reply(q))


def test_tensor_requiring_grad_is_sent_detached() -> None:
    t = torch.randn(5, requires_grad=True)
    out = roundtrip(t * 2)
    assert not out.requires_grad
    assert torch.equal(out, (t * 2).detach())


def test_tuples_come_back_as_lists() -> None:
    out = roundtrip((1, (2, 3), [4, (5,)], {"k": (torch.ones(2), "s")}))
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
    out = roundtrip(body)
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
    enc = encode(reply({"batch": batch, "batches": [batch, TensorBatch()]}))
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
    out = roundtrip(part)
    assert out.equals(part)
    assert len(out) == 5


# ---------------------------------------------------------------------------------- 6. shared memory
def test_big_tensor_goes_through_shared_memory(arena: ShmArena, reader: ShmReader) -> None:
    t = random_tensor(torch.float32, (MIB // 4 + 3,), seed=11)  # a bit over 1 MiB
    enc = encode(reply({"t": t, "small": torch.ones(3)}), arena=arena, readers=1)
    assert len(enc.frames) == 1  # a descriptor in the header, no frame
    assert enc.big is False
    assert len(enc.frames[0]) < 4096
    t_ref = t.clone()
    t.zero_()  # the arena copied the bytes: the sender may reuse its tensor
    out = decode(enc.frames, reader=reader).body["result"]
    assert_same(out["t"], t_ref)
    assert torch.equal(out["small"], torch.ones(3))


def test_shared_memory_threshold(arena: ShmArena, reader: ShmReader) -> None:
    below = torch.zeros(SHM_MIN_BYTES - 1, dtype=torch.uint8)
    at = torch.ones(SHM_MIN_BYTES, dtype=torch.uint8)
    enc = encode(reply([below, at]), arena=arena)
    assert len(enc.frames) == 2  # ``below`` is a frame, ``at`` is in shared memory
    out = decode(enc.frames, reader=reader).body["result"]
    assert torch.equal(out[0], below)
    assert torch.equal(out[1], at)


def test_shared_memory_numpy_and_batch(arena: ShmArena, reader: ShmReader) -> None:
    a = np.arange(MIB // 2, dtype=np.float64)  # 4 MiB
    batch = TensorBatch({"x": torch.arange(MIB // 4, dtype=torch.int64).reshape(-1, 2)})
    enc = encode(reply([a, batch]), arena=arena, readers=2)
    assert len(enc.frames) == 1
    out = decode(enc.frames, reader=reader, reader_index=1).body["result"]
    assert np.array_equal(out[0], a) and out[0].dtype == a.dtype
    assert out[1].equals(batch)


def test_shared_memory_without_reader_is_a_protocol_error(arena: ShmArena) -> None:
    t = torch.ones(MIB, dtype=torch.uint8)
    enc = encode(reply(t), arena=arena)
    assert len(enc.frames) == 1
    with pytest.raises(ProtocolError, match="shared-memory"):
        decode(enc.frames)


def test_shared_memory_bad_reader_index_is_a_protocol_error(
    arena: ShmArena, reader: ShmReader
) -> None:
    enc = encode(reply(torch.ones(MIB, dtype=torch.uint8)), arena=arena, readers=1)
    with pytest.raises(ProtocolError, match="descriptor"):
        decode(enc.frames, reader=reader, reader_index=3)


def test_shared_memory_descriptor_is_read_once(arena: ShmArena, reader: ShmReader) -> None:
    enc = encode(reply(torch.ones(MIB, dtype=torch.uint8)), arena=arena, readers=1)
    first = decode(enc.frames, reader=reader).body["result"]
    assert first.sum().item() == MIB
    with pytest.raises(ProtocolError):
        decode(enc.frames, reader=reader)


def test_full_arena_falls_back_to_a_frame(shm_prefix: str, reader: ShmReader) -> None:
    with ShmArena(prefix=shm_prefix, max_bytes=MIB, min_segment_bytes=MIB) as small:
        t = torch.arange(MIB // 4, dtype=torch.int32)  # 1 MiB + a header page > max_bytes
        enc = encode(reply(t), arena=small)
        assert len(enc.frames) == 2
        assert torch.equal(decode(enc.frames, reader=reader).body["result"], t)


def test_shared_memory_respects_max_frame_bytes(arena: ShmArena, reader: ShmReader) -> None:
    enc = encode(reply(torch.ones(MIB, dtype=torch.uint8)), arena=arena)
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode(enc.frames, reader=reader, max_frame_bytes=1000)


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
    out = roundtrip(t)
    resolved = t.resolve_conj().resolve_neg()
    assert_same(out, resolved)
    assert torch.equal(out, resolved)


def test_non_contiguous_conjugate_view_round_trips() -> None:
    # ``contiguous()`` copies these, which resolves the lazy bits; the codec resolves them itself.
    t = torch.tensor([[1 + 2j, 3 - 4j], [5 + 6j, -7j]], dtype=torch.complex64).conj().t()
    assert t.is_conj() and not t.is_contiguous()
    out = roundtrip(t)
    assert torch.equal(out, t.resolve_conj())
    assert out[1, 0].item() == 3 + 4j
    assert out[0, 1].item() == 5 - 6j
    imag = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert imag.is_neg()
    assert roundtrip(imag).tolist() == [-2.0, 4.0]
