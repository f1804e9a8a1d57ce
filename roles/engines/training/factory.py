"""Build the training engine a role's config names (``EngineConfig.backend``).

``fsdp`` is always there; ``megatron`` lives in ``roles/engines/training/megatron/`` and needs
megatron-core, an optional extra. That package is imported only when a role asks for it, so a
machine without the extra runs every fsdp experiment, and one that asks for megatron without it
fails the group's build call with the command that installs it.
"""

from __future__ import annotations

import importlib.util

from roles.base import RoleContext
from roles.engines.training.config import EngineConfig
from roles.engines.training.fsdp import FSDPEngine
from roles.engines.training.interface import Head, TrainingEngine

MEGATRON_EXTRA = "pip install -e '.[megatron]'"


class EngineUnavailable(ImportError):
    """The config names a backend whose optional dependency is not installed."""


def build_engine(cfg: EngineConfig, ctx: RoleContext, head: Head = "lm") -> TrainingEngine:
    """The engine of ``cfg.backend`` over the ranks of ``ctx``, holding ``cfg.model``."""
    if cfg.backend == "megatron":
        require_megatron_core()
        from roles.engines.training.megatron import MegatronEngine

        return MegatronEngine(cfg, ctx, head=head)
    return FSDPEngine(cfg, ctx, head=head)


def require_megatron_core() -> None:
    """Raise ``EngineUnavailable`` naming the extra when megatron-core cannot be imported."""
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # the ``megatron`` namespace itself is missing
        found = False
    if not found:
        raise EngineUnavailable(
            "backend: megatron needs megatron-core, which is not installed; install the extra: "
            f"{MEGATRON_EXTRA}"
        )
