"""Hugging Face Llama weights <-> megatron-core ``GPTModel`` weights, rank by rank.

Pure tensor code (no megatron import): the engine, the round-trip tests and reshard share it.

The two sides differ in three ways:

* **names** — ``model.layers.3.self_attn.o_proj.weight`` is ``decoder.layers.1.self_attention
  .linear_proj.weight`` in the second pipeline chunk that starts at layer 2;
* **fusion** — megatron holds q, k and v in one ``linear_qkv`` whose rows run group by group
  (for each query group: its query heads, then its key head, then its value head), and gate and
  up in one ``linear_fc1`` that is ``[gate shard; up shard]`` *per tensor-parallel shard*;
* **placement** — tensor parallel splits every fused weight by whole query groups (qkv), by
  rows (fc1, embeddings, output layer) or by columns (linear_proj, fc2); pipeline parallel gives
  each (stage, virtual chunk) a contiguous run of layers: chunk ``c`` of stage ``p`` holds layers
  ``[(c·pp + p)·n, (c·pp + p + 1)·n)`` with ``n = layers / (pp·vpp)``, the first chunk of stage 0
  the embedding and the last chunk of the last stage the final norm and the head.

So the natural meeting point is a rank's **HF pieces**: each Hugging Face parameter of its stage,
cut along the dim tensor parallel splits it (``HF_TP_DIM``) and kept whole otherwise. A rank's
megatron chunks are a fusion of its HF pieces (``fuse``) and back (``unfuse``); whole HF weights
are the concatenation of every tp rank's pieces (``gather_pieces``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Head = Literal["lm", "token"]


class ConvertError(ValueError):
    """Weights or a layout the converter cannot map, with what is wrong."""


@dataclass(frozen=True)
class Shape:
    """What the conversion needs to know of a Llama-family model."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    head: Head = "lm"

    @classmethod
    def of(cls, config: Any, head: Head = "lm") -> Shape:
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            groups=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            ffn=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)) and head == "lm",
            head=head,
        )


@dataclass(frozen=True)
class Place:
    """One rank's pipeline position: its tp index, stage and the (tp, pp, vpp) sizes."""

    tp: int
    pp: int
    tp_size: int = 1
    pp_size: int = 1
    vpp: int = 1

    def check(self, shape: Shape) -> None:
        stages = self.pp_size * self.vpp
        if shape.layers % stages:
            raise ConvertError(
                f"{shape.layers} layers do not split into pp={self.pp_size} x vpp={self.vpp} "
                f"= {stages} equal chunks; pick pp and vpp whose product divides {shape.layers}"
            )
        for what, count in (
            ("num_key_value_heads", shape.groups),
            ("intermediate_size", shape.ffn),
            ("vocab_size", shape.vocab),
        ):
            if count % self.tp_size:
                raise ConvertError(
                    f"tp={self.tp_size} does not divide the model's {what}={count}; "
                    "pick a tp that divides it"
                )
        if shape.heads % shape.groups:
            raise ConvertError(f"{shape.heads} heads do not form {shape.groups} query groups")


def hf_tp_dim(name: str) -> int | None:
    """The dim tensor parallel splits HF parameter ``name`` along (None: whole on each rank)."""
    leaf = name.removeprefix("model.")
    if re.search(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", leaf):
        return 0
    if re.search(r"(o_proj|down_proj)\.weight$", leaf):
        return 1
    if leaf in ("embed_tokens.weight", "lm_head.weight"):
        return 0
    return None


def chunk_layers(shape: Shape, place: Place, chunk: int) -> range:
    """The global layer indices virtual chunk ``chunk`` of ``place``'s stage holds."""
    n = shape.layers // (place.pp_size * place.vpp)
    start = (chunk * place.pp_size + place.pp) * n
    return range(start, start + n)


def stage_of_layer(shape: Shape, pp_size: int, vpp: int, layer: int) -> int:
    n = shape.layers // (pp_size * vpp)
    return (layer // n) % pp_size


def hf_names(shape: Shape) -> list[str]:
    """Every HF parameter name of the model, in the model's own order."""
    names = ["model.embed_tokens.weight"]
    for i in range(shape.layers):
        names += [f"model.layers.{i}.{leaf}" for leaf in _LAYER_LEAVES]
    names.append("model.norm.weight")
    if shape.head == "token":
        names += ["score.weight", "score.bias"]
    elif not shape.tied:
        names.append("lm_head.weight")
    return names


_LAYER_LEAVES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def hf_stage(shape: Shape, pp_size: int, vpp: int, name: str) -> int:
    """The pipeline stage holding HF parameter ``name`` (the tied head: stage 0, its owner)."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    if found:
        return stage_of_layer(shape, pp_size, vpp, int(found.group(1)))
    if name == "model.embed_tokens.weight":
        return 0
    return pp_size - 1  # final norm, lm_head, score


def piece(full: torch.Tensor, dim: int | None, parts: int, index: int) -> torch.Tensor:
    """Tensor-parallel piece ``index`` of ``parts`` along ``dim`` (the whole tensor if None)."""
    if dim is None or parts == 1:
        return full
    return full.chunk(parts, dim=dim)[index]


def rank_pieces(
    full: dict[str, torch.Tensor],
    shape: Shape,
    place: Place,
    held: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's HF pieces, cut from whole HF weights (names of its stage only); a name
    ``full`` lacks is taken from ``held`` (this rank's current pieces) when given."""
    place.check(shape)
    out = {}
    names = [n for n in hf_names(shape) if hf_stage(shape, place.pp_size, place.vpp, n) == place.pp]
    if shape.tied and place.pp == place.pp_size - 1 and place.pp_size > 1:
        # the last stage keeps its own copy of the tied embedding as the output layer
        names.append("model.embed_tokens.weight")
    for name in names:
        if name in full:
            out[name] = piece(full[name], hf_tp_dim(name), place.tp_size, place.tp).contiguous()
        elif held is not None and name in held:
            out[name] = held[name]
        else:
            raise ConvertError(f"the HF weights lack {name}")
    return out


def gather_pieces(
    pieces_by_rank: Iterable[dict[str, torch.Tensor]], shape: Shape, tp_size: int
) -> dict[str, torch.Tensor]:
    """Whole HF weights from every rank's pieces, given in rank order (tp fastest)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for pieces in pieces_by_rank:
        for name, tensor in pieces.items():
            parts.setdefault(name, []).append(tensor)
    out = {}
    for name in hf_names(shape):
        found = parts.get(name)
        if not found:
            raise ConvertError(f"no rank holds a piece of {name}")
        dim = hf_tp_dim(name)
        if dim is None or tp_size == 1:
            out[name] = found[0]
        else:
            # the first tp_size pieces are one stage's tp ranks (a tied embedding also sits on
            # the last stage: its copy comes later and is the same)
            out[name] = torch.cat(found[:tp_size], dim=dim)
    return out


# -- fusion ------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q ``[g·r·d, H]``, k and v ``[g·d, H]`` (one tp piece: ``g`` local groups) → megatron's
    ``linear_qkv`` rows, group by group: r query heads, its key head, its value head."""
    hidden = q.shape[1]
    q_g = q.reshape(groups, -1, hidden)
    k_g = k.reshape(groups, -1, hidden)
    v_g = v.reshape(groups, -1, hidden)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, hidden)


def split_qkv(
    qkv: torch.Tensor, groups: int, per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv`` (``per_group`` query heads per group)."""
    hidden = qkv.shape[1]
    rows = qkv.reshape(groups, (per_group + 2) * head_dim, hidden)
    q, k, v = rows.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, hidden).contiguous(),
        k.reshape(-1, hidden).contiguous(),
        v.reshape(-1, hidden).contiguous(),
    )


_DIRECT = {  # HF layer leaf -> megatron layer leaf, copied as they are
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def fuse(
    pieces: dict[str, torch.Tensor], shape: Shape, place: Place
) -> list[dict[str, torch.Tensor]]:
    """A rank's HF pieces → its megatron chunks' weights (one dict per virtual chunk)."""
    groups = shape.groups // place.tp_size
    chunks = []
    for chunk in range(place.vpp):
        out: dict[str, torch.Tensor] = {}
        for local, layer in enumerate(chunk_layers(shape, place, chunk)):
            hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
            for hf_leaf, mg_leaf in _DIRECT.items():
                out[mg + mg_leaf] = pieces[hf + hf_leaf]
            out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
                pieces[hf + "self_attn.q_proj.weight"],
                pieces[hf + "self_attn.k_proj.weight"],
                pieces[hf + "self_attn.v_proj.weight"],
                groups,
            )
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [pieces[hf + "mlp.gate_proj.weight"], pieces[hf + "mlp.up_proj.weight"]]
            )
        out.update(_ends(pieces, shape, place, chunk))
        chunks.append(out)
    return chunks


def _ends(
    pieces: dict[str, torch.Tensor], shape: Shape, place: Place, chunk: int
) -> dict[str, torch.Tensor]:
    out = {}
    if place.pp == 0 and chunk == 0:
        out["embedding.word_embeddings.weight"] = pieces["model.embed_tokens.weight"]
    if place.pp == place.pp_size - 1 and chunk == place.vpp - 1:
        out["decoder.final_layernorm.weight"] = pieces["model.norm.weight"]
        if shape.head == "token":
            out["output_layer.weight"] = pieces["score.weight"]
            out["output_layer.bias"] = pieces["score.bias"]
        elif not shape.tied:
            out["output_layer.weight"] = pieces["lm_head.weight"]
        elif place.pp_size > 1:
            out["output_layer.weight"] = pieces["model.embed_tokens.weight"]
    return out


def unfuse(
    chunks: list[dict[str, torch.Tensor]], shape: Shape, place: Place
) -> dict[str, torch.Tensor]:
    """Inverse of ``fuse``: a rank's megatron chunks → its HF pieces (under pp, the last stage
    of a tied model also reports its copy of the embedding)."""
    groups = shape.groups // place.tp_size
    per_group = shape.heads // shape.groups
    out: dict[str, torch.Tensor] = {}
    for chunk, state in enumerate(chunks):
        for local, layer in enumerate(chunk_layers(shape, place, chunk)):
            hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
            for hf_leaf, mg_leaf in _DIRECT.items():
                out[hf + hf_leaf] = state[mg + mg_leaf]
            q, k, v = split_qkv(
                state[mg + "self_attention.linear_qkv.weight"], groups, per_group, shape.head_dim
            )
            out[hf + "self_attn.q_proj.weight"] = q
            out[hf + "self_attn.k_proj.weight"] = k
            out[hf + "self_attn.v_proj.weight"] = v
            gate, up = state[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
            out[hf + "mlp.up_proj.weight"] = up.contiguous()
        if "embedding.word_embeddings.weight" in state:
            out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
        if "decoder.final_layernorm.weight" in state:
            out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
            if shape.head == "token":
                out["score.weight"] = state["output_layer.weight"]
                out["score.bias"] = state["output_layer.bias"]
            elif not shape.tied:
                out["lm_head.weight"] = state["output_layer.weight"]
            elif "output_layer.weight" in state:
                out["model.embed_tokens.weight"] = state["output_layer.weight"]
    return out
