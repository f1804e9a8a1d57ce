"""Parameter sets for the planner: a Llama-family model's parameters from its dimensions.

``llama_params(dims, stages)`` lists every parameter as a ``reshard.layout.Param`` with the name
transformers gives it, its shape, how tensor parallel splits it and its pipeline stage:

* q/k/v and gate/up projections: ``column`` (output features split over tp);
* o and down projections: ``row`` (input features split over tp);
* the embedding and lm_head: ``column`` (vocab-parallel, as Megatron shards them);
* norms: ``replicated``.

Layers are spread evenly over the pipeline stages (layer i on stage i·p // layers); the embedding
sits on stage 0, the final norm and lm_head on the last. A tied lm_head is the embedding itself:
it is listed once, on stage 0 (Megatron's copy on the last stage is not modelled).

``PRESETS`` holds the public dimensions of Llama-2-7B/13B/70B and Llama-3-8B; ``from_hf_config``
reads a transformers config (object, dict, ``config.json`` or model folder) without importing
transformers. ``synthetic`` builds the table's case: column/row matrices only, no replicated part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.layout import LayoutError, Param

#: bytes per element of the dtype names transformers writes into config.json
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1}
#: every synthetic dim is a multiple of this, so any tp (and dp split) up to it divides
SYNTHETIC_ALIGN = 128


@dataclass(frozen=True)
class LlamaDims:
    """The dimensions that fix a Llama-family model's parameter shapes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    itemsize: int = 2
    head_dim: int = 0  # 0: hidden // heads

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "itemsize"):
            if getattr(self, name) < 1:
                raise LayoutError(f"model dimension {name}={getattr(self, name)} must be >= 1")
        if self.heads % self.kv_heads:
            raise LayoutError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if not self.head_dim and self.hidden % self.heads:
            raise LayoutError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


PRESETS: dict[str, LlamaDims] = {
    "llama2-7b": LlamaDims(4096, 11008, 32, 32, 32, 32000),
    "llama2-13b": LlamaDims(5120, 13824, 40, 40, 40, 32000),
    "llama3-8b": LlamaDims(4096, 14336, 32, 32, 8, 128256),
    "llama2-70b": LlamaDims(8192, 28672, 80, 64, 8, 32000),
    "llama-34b": LlamaDims(8192, 22016, 48, 64, 8, 32000),  # CodeLlama-34B (the paper's 34B)
}


def layer_stage(layer: int, layers: int, stages: int) -> int:
    return layer * stages // layers


def _layer_params(dims: LlamaDims, i: int, stage: int) -> list[Param]:
    h, f, q, kv = dims.hidden, dims.intermediate, dims.heads, dims.kv_heads
    d, n = dims.head_size, dims.itemsize
    pre = f"model.layers.{i}"
    return [
        Param(f"{pre}.self_attn.q_proj.weight", (q * d, h), "column", stage, n),
        Param(f"{pre}.self_attn.k_proj.weight", (kv * d, h), "column", stage, n),
        Param(f"{pre}.self_attn.v_proj.weight", (kv * d, h), "column", stage, n),
        Param(f"{pre}.self_attn.o_proj.weight", (h, q * d), "row", stage, n),
        Param(f"{pre}.mlp.gate_proj.weight", (f, h), "column", stage, n),
        Param(f"{pre}.mlp.up_proj.weight", (f, h), "column", stage, n),
        Param(f"{pre}.mlp.down_proj.weight", (h, f), "row", stage, n),
        Param(f"{pre}.input_layernorm.weight", (h,), "replicated", stage, n),
        Param(f"{pre}.post_attention_layernorm.weight", (h,), "replicated", stage, n),
    ]


def llama_params(dims: LlamaDims, stages: int = 1) -> list[Param]:
    """Every parameter of the model, in state-dict order, placed on ``stages`` pipeline stages."""
    if not 1 <= stages <= dims.layers:
        raise LayoutError(f"pp={stages} needs 1 <= pp <= layers={dims.layers}")
    last, n = stages - 1, dims.itemsize
    out = [Param("model.embed_tokens.weight", (dims.vocab, dims.hidden), "column", 0, n)]
    for i in range(dims.layers):
        out += _layer_params(dims, i, layer_stage(i, dims.layers, stages))
    out.append(Param("model.norm.weight", (dims.hidden,), "replicated", last, n))
    if not dims.tied:
        out.append(Param("lm_head.weight", (dims.vocab, dims.hidden), "column", last, n))
    return out


def check_heads(dims: LlamaDims, tp: int) -> None:
    """Tensor parallel splits whole heads: tp must divide the head and kv-head counts."""
    if dims.heads % tp or dims.kv_heads % tp:
        raise LayoutError(
            f"tp={tp} must divide heads={dims.heads} and kv_heads={dims.kv_heads} "
            "(tensor parallel splits whole attention heads)"
        )


def _field(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    if value is None:
        if default is None:
            raise LayoutError(f"model config has no {name!r}; is it a Llama-family config?")
        return default
    return value


def _config_dict(source: str | Path) -> dict[str, Any]:
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LayoutError(f"cannot read a model config from {source}: {e}") from e
    if not isinstance(data, dict):
        raise LayoutError(f"{path} does not hold a JSON object")
    return data


def _itemsize(config: Any, itemsize: int | None) -> int:
    if itemsize is not None:
        return itemsize
    dtype = _field(config, "dtype", "") or _field(config, "torch_dtype", "")
    name = str(dtype).removeprefix("torch.")
    return DTYPE_BYTES.get(name, 2)  # unknown or unset: count 16-bit weights


def from_hf_config(config: Any, itemsize: int | None = None) -> LlamaDims:
    """The dimensions in a transformers config: a config object, its dict, a ``config.json`` or
    a model folder. ``itemsize`` overrides the config's dtype (default 2 bytes when unset)."""
    if isinstance(config, (str, Path)):
        config = _config_dict(config)
    heads = int(_field(config, "num_attention_heads"))
    hidden = int(_field(config, "hidden_size"))
    return LlamaDims(
        hidden=hidden,
        intermediate=int(_field(config, "intermediate_size")),
        layers=int(_field(config, "num_hidden_layers")),
        heads=heads,
        kv_heads=int(_field(config, "num_key_value_heads", heads)),
        vocab=int(_field(config, "vocab_size")),
        tied=bool(_field(config, "tie_word_embeddings", False)),
        itemsize=_itemsize(config, itemsize),
        head_dim=int(_field(config, "head_dim", 0)),
    )


def synthetic(
    total_bytes: int, layers: int = 8, stages: int = 1, itemsize: int = 2, hidden: int = 1024
) -> list[Param]:
    """About ``total_bytes`` of column/row matrix pairs, ``layers`` of them spread evenly over
    ``stages``; every dim a multiple of 128 so each split divides (the table's case)."""
    if hidden % SYNTHETIC_ALIGN or layers % stages:
        raise LayoutError(
            f"synthetic set: hidden={hidden} must be a multiple of {SYNTHETIC_ALIGN} and "
            f"stages={stages} must divide layers={layers}"
        )
    per_matrix = total_bytes // (2 * layers * itemsize)
    width = max(1, per_matrix // (hidden * SYNTHETIC_ALIGN)) * SYNTHETIC_ALIGN
    out: list[Param] = []
    for i in range(layers):
        stage = layer_stage(i, layers, stages)
        out.append(Param(f"layers.{i}.column", (width, hidden), "column", stage, itemsize))
        out.append(Param(f"layers.{i}.row", (hidden, width), "row", stage, itemsize))
    return out
