"""An actor for tests that also shows its random stream (kept apart from ``roles/testing.py``,
whose roles must start without importing transformers)."""

from __future__ import annotations

import torch

from roles.actor import Actor
from roles.endpoint import ONE_TO_ALL, endpoint


class ProbedActor(Actor):
    """Checkpoints must restore each rank's random stream: ``draw`` shows it."""

    @endpoint(ONE_TO_ALL)
    def draw(self) -> list[float]:
        return torch.rand(3).tolist()
