"""Tests for transport.batch.TensorBatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transport.batch import BatchError, TensorBatch


def make(n: int = 4) -> TensorBatch:
    """Rows i = 0..n-1: ids [i, 10 + i], score float(i), name "r{i}"."""
    return TensorBatch.from_dict(
        tensors={
            "ids": torch.stack([torch.arange(n), torch.arange(n) + 10], dim=1),
            "score": torch.arange(n, dtype=torch.float32),
        },
        non_tensors={"name": [f"r{i}" for i in range(n)]},
        meta={"temperature": 0.7},
    )


def names(b: TensorBatch) -> list[str]:
    return b.non_tensor("name")


# ---------------------------------------------------------------- construction / validation
def test_from_dict_stores_sequences_as_lists_and_sizes() -> None:
    b = TensorBatch.from_dict(tensors={"x": torch.zeros(3, 2)}, non_tensors={"s": ("a", "b", "c")})
    assert b.non_tensors["s"] == ["a", "b", "c"]
    assert isinstance(b.non_tensors["s"], list)
    assert b.batch_size == 3
    assert len(b) == 3
    assert b.meta == {}


def test_empty_and_meta_only_batches_have_size_zero() -> None:
    assert len(TensorBatch()) == 0
    assert TensorBatch.from_dict(meta={"step": 1}).batch_size == 0
    assert len(TensorBatch.from_dict(non_tensors={"s": []})) == 0


def test_tensor_size_mismatch_names_columns_and_sizes() -> None:
    with pytest.raises(ValueError, match=r"'b' has 2 rows but column 'a' has 3"):
        TensorBatch({"a": torch.zeros(3), "b": torch.zeros(2, 5)})


def test_non_tensor_size_mismatch() -> None:
    with pytest.raises(ValueError, match=r"'s' has 1 rows but column 'a' has 3"):
        TensorBatch({"a": torch.zeros(3)}, {"s": ["x"]})


def test_zero_dim_tensor_rejected() -> None:
    with pytest.raises(ValueError, match=r"'a' is 0-d"):
        TensorBatch({"a": torch.tensor(1.0)})


def test_wrong_column_types_rejected() -> None:
    with pytest.raises(TypeError, match=r"'s' is a tuple"):
        TensorBatch({}, {"s": ("a",)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"'s' is a str"):
        TensorBatch.from_dict(non_tensors={"s": "abc"})
    with pytest.raises(ValueError, match=r"'x' is both"):
        TensorBatch({"x": torch.zeros(1)}, {"x": [1]})


def test_getitem_by_name() -> None:
    b = make(3)
    assert b["score"] is b.tensors["score"]
    assert names(b) == ["r0", "r1", "r2"]
    with pytest.raises(KeyError, match="nope"):
        b["nope"]


def test_repr_is_short_and_lists_keys() -> None:
    r = repr(make(4))
    assert r == (
        "TensorBatch(batch_size=4, tensors={ids: int64[4, 2], score: float32[4]}, "
        "non_tensors=['name'], meta=['temperature'])"
    )


# ---------------------------------------------------------------- select / union
def test_select_keeps_requested_columns() -> None:
    b = make(2)
    s = b.select(tensor_keys=["score"], non_tensor_keys=[], meta_keys=None)
    assert list(s.tensors) == ["score"]
    assert s.non_tensors == {}
    assert s.meta == {"temperature": 0.7}
    assert s.tensors["score"] is b.tensors["score"]
    assert b.select().equals(b)


def test_select_unknown_key_raises() -> None:
    with pytest.raises(KeyError, match="'missing'"):
        make().select(non_tensor_keys=["missing"])
    with pytest.raises(KeyError, match="meta key 'lr'"):
        make().select(meta_keys=["lr"])


def test_union_merges_and_accepts_identical_shared_keys() -> None:
    b = make(3)
    extra = TensorBatch.from_dict(
        tensors={"score": torch.tensor([0.0, 1.0, 2.0]), "mask": torch.ones(3, dtype=torch.bool)},
        non_tensors={"uid": [7, 8, 9]},
        meta={"step": 5, "temperature": 0.7},
    )
    u = b.union(extra)
    assert sorted(u.tensors) == ["ids", "mask", "score"]
    assert u.non_tensors == {"name": ["r0", "r1", "r2"], "uid": [7, 8, 9]}
    assert u.meta == {"temperature": 0.7, "step": 5}


def test_union_conflicts_raise() -> None:
    b = make(3)
    with pytest.raises(ValueError, match=r"tensor key 'score' differs"):
        b.union(TensorBatch({"score": torch.tensor([0.0, 1.0, 9.0])}))
    with pytest.raises(ValueError, match=r"tensor key 'score' differs"):  # same values, other dtype
        b.union(TensorBatch({"score": torch.tensor([0, 1, 2])}))
    with pytest.raises(ValueError, match=r"non-tensor key 'name' differs"):
        b.union(TensorBatch({}, {"name": ["r0", "r1", "x"]}))
    with pytest.raises(ValueError, match=r"meta key 'temperature' differs"):
        b.union(TensorBatch.from_dict(meta={"temperature": 1.0}))
    with pytest.raises(ValueError, match=r"batch sizes differ \(3 vs 2\)"):
        b.union(TensorBatch({"z": torch.zeros(2)}))


def test_union_with_meta_only_batch() -> None:
    u = make(2).union(TensorBatch.from_dict(meta={"step": 3}))
    assert len(u) == 2
    assert u.meta == {"temperature": 0.7, "step": 3}


# ---------------------------------------------------------------- indexing
def test_int_index_keeps_dims_and_is_a_view() -> None:
    b = make(4)
    row = b[2]
    assert row.tensors["ids"].tolist() == [[2, 12]]
    assert row.tensors["score"].shape == (1,)
    assert names(row) == ["r2"]
    assert b[-1].tensors["score"].tolist() == [3.0]
    row.tensors["score"][0] = 100.0
    assert b.tensors["score"][2].item() == 100.0
    with pytest.raises(IndexError, match="row 4 out of range"):
        b[4]


def test_slice_index_is_a_view() -> None:
    b = make(5)
    s = b[1:4]
    assert s.tensors["ids"][:, 0].tolist() == [1, 2, 3]
    assert names(s) == ["r1", "r2", "r3"]
    assert s.tensors["ids"].data_ptr() == b.tensors["ids"][1].data_ptr()
    assert s.meta == {"temperature": 0.7}
    assert b[::2].tensors["score"].tolist() == [0.0, 2.0, 4.0]
    assert b[::-2].tensors["score"].tolist() == [4.0, 2.0, 0.0]
    assert names(b[::-2]) == ["r4", "r2", "r0"]
    assert len(b[4:1]) == 0


def test_list_and_long_tensor_index() -> None:
    b = make(4)
    picked = b.index([3, 0, 0])
    assert picked.tensors["ids"].tolist() == [[3, 13], [0, 10], [0, 10]]
    assert names(picked) == ["r3", "r0", "r0"]
    t = b[torch.tensor([-1, 1])]
    assert t.tensors["score"].tolist() == [3.0, 1.0]
    assert names(t) == ["r3", "r1"]
    assert len(b[[]]) == 0
    with pytest.raises(IndexError, match="out of range"):
        b[[0, 4]]


def test_bool_mask_index() -> None:
    b = make(4)
    m = b[torch.tensor([True, False, False, True])]
    assert m.tensors["score"].tolist() == [0.0, 3.0]
    assert names(m) == ["r0", "r3"]
    with pytest.raises(IndexError, match="bool mask has 3 entries, batch has 4"):
        b[torch.tensor([True, False, True])]


def test_bad_index_types() -> None:
    b = make(2)
    with pytest.raises(IndexError, match="1-D"):
        b[torch.zeros(2, 2, dtype=torch.long)]
    with pytest.raises(IndexError, match="integer or bool"):
        b[torch.tensor([0.0])]


# ---------------------------------------------------------------- split / chunk / concat
def test_split_sizes_and_views() -> None:
    b = make(5)
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert [names(p) for p in parts] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert parts[1].tensors["ids"].data_ptr() == b.tensors["ids"][2].data_ptr()
    parts[2].tensors["score"].fill_(-1.0)
    assert b.tensors["score"][4].item() == -1.0
    assert b.split(10)[0].tensors["ids"].data_ptr() == b.tensors["ids"].data_ptr()
    assert TensorBatch().split(3) == []
    with pytest.raises(ValueError, match="split size must be >= 1, got 0"):
        b.split(0)


def test_chunk_uneven_sizes() -> None:
    b = make(10)
    parts = b.chunk(4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [p.tensors["score"].tolist() for p in parts] == [
        [0.0, 1.0, 2.0],
        [3.0, 4.0, 5.0],
        [6.0, 7.0],
        [8.0, 9.0],
    ]
    assert parts[2].tensors["score"].data_ptr() == b.tensors["score"][6].data_ptr()
    ref = torch.tensor_split(torch.arange(10), 4)
    assert [len(p) for p in parts] == [len(r) for r in ref]


def test_chunk_more_parts_than_rows() -> None:
    parts = make(3).chunk(5)
    assert [len(p) for p in parts] == [1, 1, 1, 0, 0]
    assert names(parts[2]) == ["r2"]
    assert parts[4].tensors["ids"].shape == (0, 2)
    assert names(parts[4]) == []
    with pytest.raises(ValueError, match="chunk count must be >= 1, got 0"):
        make(3).chunk(0)


def test_concat_of_split_and_chunk_recovers_original() -> None:
    b = make(7)
    assert TensorBatch.concat(b.split(3)).equals(b)
    assert TensorBatch.concat(b.chunk(10)).equals(b)


def test_concat_meta_from_first_batch() -> None:
    a, c = make(1), make(2)
    c.meta["temperature"] = 1.5
    out = TensorBatch.concat([a, c])
    assert out.meta == {"temperature": 0.7}
    assert names(out) == ["r0", "r0", "r1"]


def test_concat_errors() -> None:
    with pytest.raises(ValueError, match="at least one batch"):
        TensorBatch.concat([])
    b = make(2)
    with pytest.raises(ValueError, match=r"batch 1 tensor keys .*missing \['ids'\], extra \[\]"):
        TensorBatch.concat([b, b.select(tensor_keys=["score"])])
    other = TensorBatch(dict(b.tensors), {"title": ["x", "y"]})
    with pytest.raises(ValueError, match=r"missing \['name'\], extra \['title'\]"):
        TensorBatch.concat([b, other])
    wide = TensorBatch({"ids": torch.zeros(2, 3, dtype=torch.long), "score": torch.zeros(2)})
    with pytest.raises(ValueError, match="column 'ids' cannot be concatenated"):
        TensorBatch.concat([b.select(non_tensor_keys=[]), wide])


# ---------------------------------------------------------------- repeat / pad
def test_repeat_interleaved_and_tiled() -> None:
    b = TensorBatch.from_dict(
        tensors={"x": torch.tensor([[1, 2], [3, 4]])}, non_tensors={"s": ["a", "b"]}
    )
    inter = b.repeat(2)
    assert inter.tensors["x"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4]]
    assert inter.non_tensors["s"] == ["a", "a", "b", "b"]
    tiled = b.repeat(3, interleave=False)
    assert tiled.tensors["x"].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4], [1, 2], [3, 4]]
    assert tiled.non_tensors["s"] == ["a", "b", "a", "b", "a", "b"]
    assert len(b.repeat(0)) == 0
    with pytest.raises(ValueError, match="repeat times must be >= 0"):
        b.repeat(-1)


def test_pad_to_divisor_cycles_rows_when_divisor_exceeds_size() -> None:
    b = make(3)
    padded, pad = b.pad_to_divisor(8)
    assert pad == 5
    assert len(padded) == 8
    assert padded.tensors["score"].tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0]
    assert names(padded) == ["r0", "r1", "r2", "r0", "r1", "r2", "r0", "r1"]
    assert padded.unpad(pad).equals(b)


def test_pad_to_divisor_small_pad_and_noop() -> None:
    b = make(5)
    padded, pad = b.pad_to_divisor(4)
    assert pad == 3
    assert padded.tensors["ids"][:, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    same, zero = b.pad_to_divisor(5)
    assert zero == 0
    assert same is b


def test_pad_and_unpad_errors() -> None:
    with pytest.raises(ValueError, match="cannot pad an empty batch"):
        TensorBatch({"x": torch.zeros(0, 2)}).pad_to_divisor(4)
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        make(2).pad_to_divisor(0)
    with pytest.raises(ValueError, match=r"pad_count must be in \[0, 2\], got 3"):
        make(2).unpad(3)


def test_unpad_is_a_view() -> None:
    b = make(4)
    u = b.unpad(1)
    assert names(u) == ["r0", "r1", "r2"]
    assert u.tensors["ids"].data_ptr() == b.tensors["ids"].data_ptr()


# ---------------------------------------------------------------- to / equals
def test_to_moves_tensors_and_copies_containers() -> None:
    b = make(2)
    moved = b.to("cpu")
    assert moved.tensors["ids"].device == torch.device("cpu")
    assert moved.equals(b)
    moved.non_tensors["name"].append("extra")
    moved.meta["k"] = 1
    assert names(b) == ["r0", "r1"]
    assert "k" not in b.meta
    as_float = TensorBatch({"x": torch.tensor([1, 2])}).to(torch.device("cpu"))
    assert as_float.tensors["x"].dtype == torch.int64


def test_equals_is_exact() -> None:
    a = make(3)
    assert a.equals(make(3))
    assert not a.equals(make(2))
    b = make(3)
    b.tensors["score"] = b.tensors["score"].double()
    assert not a.equals(b)
    c = make(3)
    c.non_tensors["name"][1] = "zz"
    assert not a.equals(c)
    d = make(3)
    d.meta["temperature"] = 0.8
    assert not a.equals(d)
    assert not a.equals(a.select(tensor_keys=["ids"]))


def test_equals_handles_array_values_and_no_eq_magic() -> None:
    a = TensorBatch({}, {"arr": [np.array([1, 2])]}, {"w": torch.ones(2)})
    b = TensorBatch({}, {"arr": [np.array([1, 2])]}, {"w": torch.ones(2)})
    c = TensorBatch({}, {"arr": [np.array([1, 3])]}, {"w": torch.ones(2)})
    assert a.equals(b)
    assert not a.equals(c)
    assert a != b  # identity comparison only: no __eq__ is defined
    assert "__eq__" not in TensorBatch.__dict__


# ---------------------------------------------------------------- typed column access
def test_tensor_and_non_tensor_return_the_columns_themselves() -> None:
    b = make(3)
    assert b.tensor("ids") is b.tensors["ids"]
    assert b.non_tensor("name") == ["r0", "r1", "r2"]
    assert b.non_tensor("name") is b.non_tensors["name"]
    b.require_tensors("ids", "score")  # all present: no error


def test_a_column_of_the_other_kind_is_a_batch_error_naming_it() -> None:
    b = make(2)
    with pytest.raises(BatchError) as info:
        b.tensor("name")
    assert str(info.value) == "column 'name' must be a tensor column; got a non-tensor column"
    with pytest.raises(BatchError) as info:
        b.non_tensor("ids")
    assert str(info.value) == "column 'ids' must be a non-tensor column; got a tensor column"


def test_a_missing_column_is_a_batch_error_listing_what_the_batch_has() -> None:
    b = make(2)
    with pytest.raises(BatchError) as info:
        b.tensor("input_ids")
    assert str(info.value) == (
        "the batch has no column 'input_ids'; it has tensor columns ['ids', 'score'] "
        "and non-tensor columns ['name']"
    )
    with pytest.raises(BatchError, match="no column 'prompt'"):
        b.non_tensor("prompt")
    assert isinstance(info.value, ValueError)  # bad input, as callers catch it


def test_require_tensors_names_every_missing_column_at_once() -> None:
    with pytest.raises(BatchError) as info:
        make(2).require_tensors("ids", "mask", "name", "returns")
    message = str(info.value)
    assert message.startswith("the batch lacks tensor column(s) ['mask', 'name', 'returns'];")
    assert "tensor columns ['ids', 'score']" in message
