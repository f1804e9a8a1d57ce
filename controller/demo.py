"""The demo program: fit a linear model with a 2-rank data-parallel group.

The whole controller side of a distributed training job, as hybridflow programs read::

    model = LinearRegressorClient(controller, "linear")
    for step in range(steps):
        metrics = await model.train_step(next_batch())
"""

from __future__ import annotations

from typing import Any

import torch

from controller.clients import LinearRegressorClient
from controller.placement import GroupSpec, RoleSpec
from controller.server import Controller
from transport.batch import TensorBatch


def demo_placement(nproc: int = 2, dim: int = 8, fanout: str = "socket") -> list[GroupSpec]:
    role = RoleSpec(cls="roles.demo:LinearRegressor", config={"dim": dim, "lr": 0.1})
    return [
        GroupSpec.model_validate(
            {"name": "trainer", "roles": {"linear": role}, "nproc": nproc, "fanout": fanout}
        )
    ]


async def train_linear(
    controller: Controller, steps: int = 60, dim: int = 8, batch: int = 256, seed: int = 0
) -> dict[str, Any]:
    model = LinearRegressorClient(controller, "linear")
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(dim, 1, generator=gen)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, dim, generator=gen)
        y = x @ w_true + 0.01 * torch.randn(batch, 1, generator=gen)
        metrics = await model.train_step(TensorBatch.from_dict({"x": x, "y": y}))
        losses.append(metrics[0]["loss"])  # dp-split: one dict per dp rank, all equal
    weights = await model.weights()
    return {
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "weight_error": float((weights["weight"].T - w_true).abs().max()),
        "replicas_agree": await model.replicas_agree(),
        "steps": steps,
    }
