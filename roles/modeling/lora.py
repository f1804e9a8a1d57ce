"""LoRA adapters on a Hugging Face causal LM, with PEFT's own LoRA layers: attach them, switch
them off, merge them, write them as a folder PEFT loads.

A model with adapters keeps its Hugging Face module tree; PEFT's ``inject_adapter_in_model``
wraps each targeted ``nn.Linear`` in a LoRA layer, so the parameter names change only there:
``...q_proj.weight`` becomes ``...q_proj.base_layer.weight`` beside ``...q_proj.lora_A.default
.weight`` (``[r, in]``) and ``...lora_B.default.weight`` (``[out, r]``). The base weights are
frozen and never change during a run; the layer computes ``x W0ᵀ + s · (x Aᵀ) Bᵀ`` with
``s = alpha / r``, and ``B`` starts at zero, so a fresh adapter is the base model exactly.

What the rest of hybridflow uses:

* ``LoraSettings`` — the ``lora:`` block of an engine role (rank, alpha, dropout, target
  modules) and the PEFT ``LoraConfig`` it stands for;
* ``check_targets`` — the target modules against the model's config, before any process starts;
* ``attach`` — adapters into a module (training engines and the rollout role alike);
* ``adapters_disabled`` — the base model for a block: the reference's log-probs in a LoRA run
  come from the actor this way, with no second copy of the model;
* ``adapter_values`` / ``adapters_set_to`` — a frozen copy of the adapters, and the model
  computing with it for a block: the reference once an earlier stage (SFT) trained them;
* ``effective_weight`` — ``W0 + s · B A`` of one projection, computed afresh from the pristine
  base (what the native generator fuses per call: no merge drifts, nothing is un-merged);
* ``merged_state`` — a state dict in plain Hugging Face names with every adapter merged (export,
  ``state_dict`` for other roles, vLLM's weights);
* ``write_adapter_folder`` — ``adapter_config.json`` + ``adapter_model.safetensors`` that
  ``peft.PeftModel.from_pretrained(base, folder)`` loads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

#: every attention and MLP projection of a Llama, Mistral or Qwen2 decoder layer: adapting all
#: of them (the MLP above all) is what lets LoRA match full fine-tuning in RL
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"  # PEFT's name of the one adapter
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


class LoraSettings(BaseModel):
    """The ``lora:`` block of an engine role: low-rank adapters trained instead of the weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(16, ge=1, description="r, the adapters' inner dimension")
    alpha: int = Field(
        32, ge=1, description="the update is scaled by alpha / rank (PEFT's lora_alpha)"
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapters' input during training steps only (log-prob "
        "passes and generation run without it)",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        min_length=1,
        description="names of the nn.Linear modules that get adapters (the last part of the "
        "module name); default: every attention and MLP projection of a Llama/Qwen2 layer",
    )

    @field_validator("target_modules")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"target_modules {value} names a module twice")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str | None = None) -> Any:
        """The PEFT ``LoraConfig`` these settings stand for."""
        import peft

        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model,
        )


def linear_names(model_config: Any) -> set[str]:
    """The short names of the model's ``nn.Linear`` modules (built on the meta device: no
    weights are allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def check_targets(settings: LoraSettings, model_config: Any) -> None:
    """Raise ValueError naming ``target_modules`` when one is not a linear module of the model
    (``lm_head`` is refused too: the generators fuse the head as it is)."""
    known = linear_names(model_config) - {"lm_head"}
    unknown = [t for t in settings.target_modules if t not in known]
    if unknown:
        kind = getattr(model_config, "model_type", "this model")
        raise ValueError(
            f"target_modules: {unknown} not a linear layer of a {kind} decoder; it has "
            f"{sorted(known)}"
        )


def attach(module: torch.nn.Module, settings: LoraSettings) -> int:
    """Adapters into ``module`` in place (PEFT's LoRA layers, B = 0); only they require grad.
    Returns how many adapter parameters there are."""
    import peft

    peft.inject_adapter_in_model(settings.peft_config(), module)
    for layer in lora_layers(module):
        # PEFT casts each layer's input to the adapters' dtype (fp32 master weights) before
        # the low-rank product: under a bf16 autocast that is a copy of every activation, cast
        # straight back by the autocast. Off: the same numbers, without the copies.
        layer.cast_input_dtype_enabled = False
    count = 0
    for name, param in module.named_parameters():
        adapter = is_adapter(name)
        param.requires_grad_(adapter)
        count += param.numel() if adapter else 0
    if count == 0:
        raise ValueError(f"target_modules {settings.target_modules} matched no layer")
    return count


def is_adapter(name: str) -> bool:
    return name.endswith((_A, _B))


def lora_layers(module: torch.nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def has_adapters(module: torch.nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in module.named_parameters())


@contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The base model for the block: every LoRA layer computes ``x W0ᵀ`` alone, the same
    operation as the plain ``nn.Linear`` it wraps (bitwise the base model's outputs)."""
    layers = lora_layers(module)
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield module
    finally:
        for layer, was in zip(layers, before, strict=True):
            layer._disable_adapters = was


def adapter_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's adapter tensors (its local shards under FSDP), by name."""
    return {n: _local(p).detach().clone() for n, p in module.named_parameters() if is_adapter(n)}


@contextmanager
def adapters_set_to(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """The module computes with adapter ``values`` (``adapter_values`` of an earlier moment) for
    the block, then gets its own back: a frozen copy of adapters as a second model over the same
    base (the reference of a LoRA run after an SFT stage), at the cost of two small copies."""
    held = {n: _local(p) for n, p in module.named_parameters() if is_adapter(n)}
    if held.keys() != values.keys():
        raise ValueError(f"{len(values)} saved adapters do not fit the {len(held)} of the model")
    own = {n: t.detach().clone() for n, t in held.items()}
    with torch.no_grad():
        for n, t in held.items():
            t.copy_(values[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in held.items():
                t.copy_(own[n])


@contextmanager
def adapter_dropout(module: torch.nn.Module) -> Iterator[None]:
    """The adapters' dropout switched on for the block (a training step); the engines keep
    the module in eval mode otherwise, so log-prob passes never drop."""
    drops = [
        d
        for layer in lora_layers(module)
        for d in layer.lora_dropout.values()
        if isinstance(d, torch.nn.Dropout)
    ]
    for drop in drops:
        drop.train()
    try:
        yield
    finally:
        for drop in drops:
            drop.eval()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def is_lora_layer(proj: Any) -> bool:
    return hasattr(proj, "lora_A") and hasattr(proj, "base_layer")


def effective_weight(proj: Any) -> torch.Tensor:
    """The weight ``proj`` computes with: its own for a plain linear layer; for a LoRA layer a
    new tensor ``W0 + s · B A`` from the untouched base (or ``W0`` itself, adapters off)."""
    if not is_lora_layer(proj):
        return _local(proj.weight)
    base = _local(proj.base_layer.weight)
    if proj.disable_adapters or proj.merged:
        return base
    merged = base
    # in the weights' own dtype even inside a generator's bf16 autocast (a merge in bf16 would
    # round W0 itself); the generator casts the result once, as it casts plain weights
    with torch.autocast(base.device.type, enabled=False):
        for name in proj.active_adapters:
            if name not in proj.lora_A:
                continue
            a, b = _local(proj.lora_A[name].weight), _local(proj.lora_B[name].weight)
            merged = torch.addmm(merged, b, a, alpha=proj.scaling[name])
    return merged


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict of a model with adapters (injected names) in plain Hugging Face names, each
    adapted weight replaced by ``W0 + scaling · B A`` (computed in fp32, cast back)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if _BASE not in name:
            out[name] = tensor
            continue
        owner, _, leaf = name.partition(_BASE)
        plain = f"{owner}.{leaf}"
        a, b = state.get(owner + _A), state.get(owner + _B)
        if leaf != "weight" or a is None or b is None:
            out[plain] = tensor
            continue
        delta = (b.double() @ a.double()) * scaling
        out[plain] = (tensor.double() + delta).to(tensor.dtype)
    return out


def injected_names(state: dict[str, torch.Tensor], own: set[str]) -> dict[str, torch.Tensor]:
    """Plain Hugging Face names mapped onto a model with adapters: ``X.weight`` becomes
    ``X.base_layer.weight`` where the model wraps ``X`` (names it already has stay)."""
    out = {}
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        wrapped = f"{owner}.base_layer.{leaf}"
        out[wrapped if name not in own and wrapped in own else name] = tensor
    return out


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``state`` under the keys PEFT's adapter file uses
    (``base_model.model.X.lora_A.weight``)."""
    return {
        "base_model.model." + name.replace(f".{ADAPTER}.", "."): tensor.contiguous()
        for name, tensor in state.items()
        if is_adapter(name)
    }


def write_adapter_folder(
    path: str | Path, state: dict[str, torch.Tensor], settings: LoraSettings, base_model: str
) -> Path:
    """A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) of the
    adapters in ``state``, written aside and renamed into place."""
    from safetensors.torch import save_file

    target = Path(path)
    aside = target.with_name(f".{target.name}.partial")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    config = settings.peft_config(base_model).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (aside / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    tensors = {k: v.detach().float().cpu() for k, v in adapter_state(state).items()}
    save_file(tensors, aside / "adapter_model.safetensors", metadata={"format": "pt"})
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        shutil.rmtree(old)
    os.replace(aside, target)
    return target


def adapter_folder(export: str | Path) -> Path:
    """Where an export's PEFT adapter folder goes: beside the merged folder, ``NAME-adapter``
    (inside it, transformers would find ``adapter_config.json`` and apply the adapter twice)."""
    path = Path(export)
    return path.with_name(f"{path.name}-adapter")
