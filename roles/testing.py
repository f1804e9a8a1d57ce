"""Small roles for tests and benchmarks: each exercises one behaviour of the mesh.

They are real roles (real processes, real process groups), just with trivial bodies, so a test
can tell the mesh's behaviour apart from a model's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from roles.base import Role, RoleContext
from roles.endpoint import DP_SPLIT, ONE_TO_ALL, RANK_ZERO, endpoint
from transport.batch import TensorBatch


class Echo(Role):
    """Returns what it gets, tagged with where it ran."""

    def __init__(self, ctx: RoleContext, tag: str = "echo") -> None:
        super().__init__(ctx)
        self.tag = tag
        self.calls = 0

    @endpoint(ONE_TO_ALL)
    def ping(self) -> None:
        return None

    @endpoint(ONE_TO_ALL)
    def echo(self, value: Any) -> Any:
        self.calls += 1
        return value

    @endpoint(ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        """Every rank's view, gathered through the process group (proves SPMD execution)."""
        mine = torch.tensor([self.ctx.rank, os.getpid(), self.calls], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(everyone, mine, group=self.ctx.process_group)
        return {
            "tag": self.tag,
            "rank": self.ctx.rank,
            "ranks": [int(t[0]) for t in everyone],
            "pids": [int(t[1]) for t in everyone],
            "calls": [int(t[2]) for t in everyone],
        }

    @endpoint(DP_SPLIT)
    def shard_info(self, batch: TensorBatch) -> TensorBatch:
        """Each row tagged with the dp/tp rank that saw it."""
        n = len(batch)
        return batch.union(
            TensorBatch.from_dict(
                {
                    "dp_rank": torch.full((n,), self.ctx.dp_rank),
                    "tp_rank": torch.full((n,), self.ctx.tp_rank),
                    "seen_by": torch.full((n,), self.ctx.rank),
                }
            )
        )

    @endpoint(DP_SPLIT)
    def shard_sizes(self, batch: TensorBatch) -> int:
        return len(batch)

    @endpoint(RANK_ZERO)
    def only_zero(self) -> int:
        self.calls += 1
        return self.ctx.rank

    @endpoint(ONE_TO_ALL)
    def checksum(self, t: torch.Tensor) -> int:
        """Wrapping int64 sum over the raw bytes: the receiver reads every byte."""
        raw = t.reshape(-1).view(torch.uint8)
        head = raw[: raw.numel() // 8 * 8].view(torch.int64).sum()
        return int(head) + int(raw[raw.numel() // 8 * 8 :].sum())


class Faulty(Role):
    """Raises, sleeps or exits on request, on a chosen rank."""

    @endpoint(ONE_TO_ALL)
    def fail_on(self, rank: int, message: str = "boom") -> int:
        if self.ctx.rank == rank:
            raise ValueError(f"{message} on rank {rank}")
        return self.ctx.rank

    @endpoint(ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        start = time.monotonic()
        end = start + seconds
        while time.monotonic() < end:  # busy, holding the GIL in Python, like a training step
            sum(range(10_000))
        return time.monotonic() - start

    @endpoint(ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @endpoint(ONE_TO_ALL)
    def unsendable(self) -> Any:
        return object()


# -- rule rewards for tests: each shows one behaviour of the reward role ----------------------


def length_reward(prompt: str, response: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """score = len(response); extra columns: the prompt's length and metadata['bonus'] (the
    ``note`` is not a number, so it is no column)."""
    return {
        "score": float(len(response)),
        "prompt_len": len(prompt),
        "bonus": metadata["bonus"],
        "note": "text",
    }


def failing_reward(prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """Raises on a response containing 'boom', scores 1.0 otherwise."""
    if "boom" in response:
        raise ZeroDivisionError("boom in the response")
    return 1.0


def text_reward(prompt: str, response: str, metadata: dict[str, Any]) -> str:
    """Returns a string: not a score."""
    return response


def starts_with_one(prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """1.0 when the response starts with the digit 1: an easy target RL moves within steps."""
    return 1.0 if response.startswith("1") else 0.0
