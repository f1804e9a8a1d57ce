"""What the training engines share (``fsdp.py`` and ``megatron/``), in one place.

- ``EngineError``, the error of a model, batch or checkpoint an engine cannot take;
- ``load_module``: the Hugging Face model every engine starts from, seeded alike on every rank
  (the megatron engine converts it, so both engines start from the same weights and head);
- the DTensor tensor-parallel split (``TP_PLAN``, ``check_tp``, ``tensor_parallel``,
  ``split_dim``): the fsdp engine trains with it and the rollout role generates with it (the
  native generation engine at tp > 1);
- sums over the data-parallel ranks: ``global_counts`` (the token and sequence counts losses are
  normalised by) and ``sum_over_dp`` (metrics);
- ``skipped_step``: the warning of an optimizer step skipped on a non-finite gradient norm;
- folders written aside and renamed into place, so a crash leaves the previous one intact:
  ``checkpoint_aside`` (a collective ``save``), ``open_checkpoint`` (``load``'s checks) and
  ``write_hf_folder`` (``export``'s Hugging Face folder, on rank 0).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from roles.engines.training.config import EngineConfig
from roles.engines.training.interface import Head
from roles.modeling.losses import count
from roles.modeling.models import (
    check_model_dir,
    faithful_tokenizer,
    load_causal_lm,
    load_tokenizer,
)

log = logging.getLogger("hybridflow.engine")

#: what a checkpoint records of the engine that wrote it; ``load`` refuses any other
DESCRIPTION_FILE = "engine.json"

# Column-wise splits the output features (heads), row-wise the input features; a row-wise layer
# ends with an all-reduce over tp.
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


class EngineError(ValueError):
    """A model or batch this engine cannot run, with what to change."""


def load_module(cfg: EngineConfig, head: Head) -> torch.nn.Module:
    """The model, in fp32 on CPU, identical on every rank (seeded before any head is created)."""
    torch.manual_seed(cfg.seed)
    if head == "lm":
        module = load_causal_lm(cfg.model)
    else:
        from transformers import AutoModelForTokenClassification

        config, _ = check_model_dir(cfg.model)
        config.num_labels = 1
        config.classifier_dropout = 0.0
        module = AutoModelForTokenClassification.from_pretrained(
            cfg.model, config=config, dtype=torch.float32
        )
    module.eval()  # no dropout anywhere: ranks and recomputations must agree
    return module


# -- tensor parallel (DTensor) ------------------------------------------------------------------


def check_tp(config: Any, tp: int) -> None:
    """Tensor parallel splits heads and MLP features: ``tp`` must divide each count."""
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field)
        if value % tp:
            raise EngineError(
                f"tp={tp} does not divide the model's {field}={value}; pick a tp that divides it"
            )


def decoder_layers(module: torch.nn.Module) -> torch.nn.ModuleList:
    base = getattr(module, str(module.base_model_prefix))
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise EngineError(f"{type(module).__name__} has no decoder layers to split")
    return layers


def tensor_parallel(module: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every decoder layer's projections over ``tp_mesh`` by ``TP_PLAN`` (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_tp(module.config, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in TP_PLAN.items()}
    for layer in decoder_layers(module):
        parallelize_module(layer, tp_mesh, plan)


def split_dim(placement: Placement) -> int | None:
    """The tensor dim a placement splits, or None when it replicates. FSDP2 on top of tensor
    parallel splits with ``_StridedShard``, which (torch 2.13) is no ``Shard`` and answers
    ``is_shard()`` with False — but it splits its ``dim`` all the same."""
    if placement.is_shard() or type(placement).__name__ == "_StridedShard":
        return int(placement.dim)  # type: ignore[attr-defined]
    return None


# -- sums over data parallel --------------------------------------------------------------------


def global_counts(
    mask: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[float, float]:
    """Tokens and sequences under ``mask`` over all data-parallel ranks (``group``; None: this
    rank's alone), as the losses' normaliser (``roles/modeling/losses.py``)."""
    counts = torch.tensor(count(mask), dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return float(counts[0]), float(counts[1])


def sum_over_dp(
    values: dict[str, torch.Tensor], group: dist.ProcessGroup | None, device: torch.device
) -> dict[str, float]:
    """Each value summed over the data-parallel ranks of ``group`` (every rank passes the same
    keys) in fp64, with one all-reduce; None: this rank's values as they are."""
    names = sorted(values)
    stacked = torch.stack(
        [torch.as_tensor(values[n], dtype=torch.float64, device=device) for n in names]
    )
    if group is not None and names:
        dist.all_reduce(stacked, group=group)
    return {n: float(v) for n, v in zip(names, stacked, strict=True)}


# -- folders written aside ----------------------------------------------------------------------


def skipped_step(step: int, grad_norm: float) -> None:
    """Say (once, on rank 0) that optimizer step ``step`` was skipped: its gradient norm is
    ``grad_norm``, not finite (every rank has the same all-reduced norm and skips alike)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(
            "optimizer step %d skipped: the gradient norm is %s (a NaN or inf in the loss or its "
            "inputs); the weights are as they were",
            step,
            grad_norm,
        )


def rank_file(folder: Path, rank: int) -> Path:
    """A rank's own file in a checkpoint folder."""
    return folder / f"rank{rank}.pt"


@contextmanager
def checkpoint_aside(
    path: str | Path, rank: int, barrier: Callable[[], None], description: dict[str, Any]
) -> Iterator[Path]:
    """A collective: every rank writes its part of a checkpoint into the folder this yields
    (``PATH.partial``, made fresh by rank 0); when every rank is done, rank 0 adds the engine's
    ``description`` and renames the folder to ``path``. An error in the block renames nothing."""
    final = Path(path)
    aside = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir(parents=True)
    barrier()
    yield aside
    barrier()
    if rank == 0:
        (aside / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1))
        replace_dir(aside, final)
    barrier()


def open_checkpoint(path: str | Path, rank: int, description: dict[str, Any]) -> Path:
    """The checkpoint folder at ``path`` once it is known to hold this rank's part and to have
    been written by an engine of this ``description``; ``EngineError`` otherwise."""
    folder = Path(path)
    if not rank_file(folder, rank).exists():
        raise EngineError(f"no checkpoint for rank {rank} at {folder}")
    saved = json.loads((folder / DESCRIPTION_FILE).read_text())
    if saved != description:
        raise EngineError(f"checkpoint {folder} was written by {saved}, not {description}")
    return folder


def write_hf_folder(
    path: str | Path, weights: dict[str, torch.Tensor], model_config: Any, model_dir: str
) -> None:
    """Whole ``weights`` as a plain Hugging Face folder (safetensors, the config, the tokenizer
    of ``model_dir``), written aside and renamed into place; one rank writes it."""
    from safetensors.torch import save_file

    final = Path(path)
    aside = final.with_name(final.name + ".partial")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    save_file(weights, str(aside / "model.safetensors"), metadata={"format": "pt"})
    model_config.save_pretrained(aside)
    faithful_tokenizer(load_tokenizer(model_dir)).save_pretrained(aside)
    replace_dir(aside, final)


def replace_dir(aside: Path, final: Path) -> None:
    """Swap a finished folder into place; an older one is moved away first and then deleted."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(aside, final)
    shutil.rmtree(old, ignore_errors=True)
