"""The demo role: a linear model trained data-parallel over its group (README's main job).

Small on purpose, real in every part that matters: the controller's batch is split over the
data-parallel ranks (``DP_SPLIT``), each rank computes its share of a globally normalised MSE,
gradients are all-reduced in the group's gloo process group, and every rank steps the same
optimizer — so the ranks stay bit-identical and the result equals one process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from roles.base import Role, RoleContext
from roles.runtime.endpoint import DP_SPLIT, ONE_TO_ALL, RANK_ZERO, endpoint
from transport.batch import TensorBatch


class LinearRegressor(Role):
    def __init__(self, ctx: RoleContext, dim: int = 8, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__(ctx)
        torch.manual_seed(seed)  # same init on every rank
        self.model = torch.nn.Linear(dim, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size > 1:
            dist.all_reduce(t, group=self.ctx.process_group)
        return t

    @endpoint(DP_SPLIT)
    def train_step(self, batch: TensorBatch) -> dict[str, float]:
        """One SGD step on the global batch; returns the global loss before the step."""
        x, y = batch.tensor("x"), batch.tensor("y")
        rows = self._all_reduce(torch.tensor(float(len(batch))))
        self.opt.zero_grad()
        loss = ((self.model(x) - y) ** 2).sum() / rows
        loss.backward()
        for p in self.model.parameters():
            assert p.grad is not None
            self._all_reduce(p.grad)
        self.opt.step()
        return {"loss": float(self._all_reduce(loss.detach().clone())), "rows": float(rows)}

    @endpoint(DP_SPLIT)
    def predict(self, batch: TensorBatch) -> TensorBatch:
        with torch.no_grad():
            y_hat = self.model(batch.tensor("x"))
        return TensorBatch.from_dict({"y_hat": y_hat})

    @endpoint(RANK_ZERO)
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @endpoint(ONE_TO_ALL)
    def replicas_agree(self) -> bool:
        """True when every rank holds bit-identical weights."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(self.ctx.world_size)]
        if self.ctx.world_size > 1:
            dist.all_gather(gathered, flat, group=self.ctx.process_group)
        else:
            gathered = [flat]
        return all(torch.equal(g, flat) for g in gathered)

    @endpoint(ONE_TO_ALL)
    def info(self) -> dict[str, int]:
        return {"rank": self.ctx.rank, "world_size": self.ctx.world_size}
