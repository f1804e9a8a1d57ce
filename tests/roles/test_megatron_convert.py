"""HF Llama weights <-> megatron-core GPTModel weights (``roles/engines/training/megatron/
convert.py``): the fused layouts by hand, the layer placement over pipeline stages and virtual
chunks, and HF -> megatron -> HF bitwise on 1, 2 and 4 ranks (tp, pp, tp x pp, pp x vpp), for
a causal LM, a tied one and a token-classification (critic) head."""

from __future__ import annotations

import pytest
import torch

from roles.engines.training.megatron.convert import (
    ConvertError,
    Place,
    Shape,
    chunk_layers,
    fuse,
    fuse_qkv,
    gather_pieces,
    hf_names,
    rank_pieces,
    split_qkv,
    unfuse,
)

SHAPE = Shape(layers=8, hidden=8, heads=8, groups=4, head_dim=2, ffn=12, vocab=16, tied=False)
# (tp, pp, vpp): 1, 2 and 4 ranks
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 2, 2), (2, 2, 2)]


def hf_weights(shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of every HF parameter at its full shape."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.groups * shape.head_dim
    leaf_shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (shape.ffn, h),
        "mlp.up_proj.weight": (shape.ffn, h),
        "mlp.down_proj.weight": (h, shape.ffn),
    }
    out = {}
    for name in hf_names(shape):
        leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        dims = (
            leaf_shapes.get(leaf)
            or {
                "model.embed_tokens.weight": (shape.vocab, h),
                "model.norm.weight": (h,),
                "lm_head.weight": (shape.vocab, h),
                "score.weight": (1, h),
                "score.bias": (1,),
            }[name]
        )
        out[name] = torch.randn(dims, generator=gen)
    return out


def test_qkv_rows_run_group_by_group() -> None:
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # 4 query heads of dim 1, 2 per group
    k, v = torch.tensor([[20.0], [21.0]]), torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, groups=2)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = split_qkv(fused, groups=2, per_group=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_fc1_is_gate_then_up_per_tp_shard() -> None:
    shape = Shape(layers=1, hidden=1, heads=2, groups=2, head_dim=1, ffn=4, vocab=4, tied=False)
    full = hf_weights(shape)
    full["model.layers.0.mlp.gate_proj.weight"] = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    full["model.layers.0.mlp.up_proj.weight"] = torch.tensor([[4.0], [5.0], [6.0], [7.0]])
    fc1 = [
        fuse(rank_pieces(full, shape, Place(t, 0, 2)), shape, Place(t, 0, 2))[0][
            "decoder.layers.0.mlp.linear_fc1.weight"
        ]
        for t in range(2)
    ]
    assert [f.flatten().tolist() for f in fc1] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_virtual_chunks_take_layers_round_robin() -> None:
    # megatron-core's own example: 8 layers, pp 2, vpp 2 -> stage 0 holds [0, 1] and [4, 5]
    got = {
        (p, c): list(chunk_layers(SHAPE, Place(0, p, 1, 2, 2), c))
        for p in range(2)
        for c in range(2)
    }
    assert got == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}


def test_a_stage_holds_its_ends() -> None:
    full = hf_weights(SHAPE)
    first = fuse(rank_pieces(full, SHAPE, Place(0, 0, 1, 2, 2)), SHAPE, Place(0, 0, 1, 2, 2))
    last = fuse(rank_pieces(full, SHAPE, Place(0, 1, 1, 2, 2)), SHAPE, Place(0, 1, 1, 2, 2))
    assert "embedding.word_embeddings.weight" in first[0]
    assert "embedding.word_embeddings.weight" not in first[1]
    assert "output_layer.weight" in last[1] and "decoder.final_layernorm.weight" in last[1]
    assert "output_layer.weight" not in last[0]
    assert sorted(k for k in first[1] if k.startswith("decoder.layers.")) == sorted(
        k for k in first[0] if k.startswith("decoder.layers.")
    )


@pytest.mark.parametrize("variant", ["lm", "tied", "token"])
@pytest.mark.parametrize(("tp", "pp", "vpp"), LAYOUTS)
def test_hf_to_megatron_to_hf_is_bitwise(variant: str, tp: int, pp: int, vpp: int) -> None:
    shape = Shape(
        **{
            **SHAPE.__dict__,
            "tied": variant == "tied",
            "head": "token" if variant == "token" else "lm",
        }
    )
    full = hf_weights(shape, seed=tp * 10 + pp)
    pieces = []
    for rank in range(tp * pp):  # tp fastest, then pp
        place = Place(rank % tp, rank // tp, tp, pp, vpp)
        chunks = fuse(rank_pieces(full, shape, place), shape, place)
        assert len(chunks) == vpp
        pieces.append(unfuse(chunks, shape, place))
    back = gather_pieces(pieces, shape, tp)
    assert set(back) == set(full)
    for name, tensor in full.items():
        assert torch.equal(back[name], tensor), name


def test_a_tied_model_keeps_a_copy_of_the_embedding_on_the_last_stage() -> None:
    shape = Shape(**{**SHAPE.__dict__, "tied": True})
    full = hf_weights(shape)
    last = Place(0, 1, 1, 2)
    chunk = fuse(rank_pieces(full, shape, last), shape, last)[0]
    assert torch.equal(chunk["output_layer.weight"], full["model.embed_tokens.weight"])
    assert "lm_head.weight" not in hf_names(shape)


def test_sizes_that_do_not_split_are_refused() -> None:
    full = hf_weights(SHAPE)
    with pytest.raises(ConvertError, match="tp=8 does not divide the model's num_key_value_heads"):
        rank_pieces(full, SHAPE, Place(0, 0, 8, 1))
    with pytest.raises(ConvertError, match="8 layers do not split into pp=3"):
        rank_pieces(full, SHAPE, Place(0, 0, 1, 3))
    with pytest.raises(ConvertError, match=r"lack model\.norm\.weight"):
        rank_pieces({k: v for k, v in full.items() if k != "model.norm.weight"}, SHAPE, Place(0, 0))
