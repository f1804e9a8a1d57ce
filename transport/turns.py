"""What a multi-turn rollout and a generator serving at the iteration level say to each other.

``controller/agent.py``'s turn server hands each trajectory's next turn to the generator as a
``TurnRequest`` the moment the trajectory asks, and gets each turn back as a ``TurnResult`` the
moment the engine finishes it (``roles/engines/generation/iteration.py``): one call,
``exchange(channel, requests, sampling, wait_s)``, submits the new requests and returns the
channel's finished turns, waiting up to ``wait_s`` for the first while any are out. A channel is
one batch of trajectories (several may share a generator: batches generated ahead); each call
returns only its own channel's turns.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TurnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int = Field(ge=0, description="the turn's name within its channel")
    prompt_ids: list[int] = Field(min_length=1, description="the whole trajectory so far")
    seed: int = Field(description="the turn's sampling seed (as a generation row's seed)")
    max_new: int = Field(ge=1, description="the turn's own token limit")
    session: str | None = Field(None, description="the trajectory: the generator keeps its KV")
    replica: int = Field(0, ge=0, description="the generation replica that serves it (dp rank)")


class TurnResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int = Field(ge=0)
    tokens: list[int] = Field(description="the sampled tokens")
    log_probs: list[float] = Field(description="each sampled token's log-prob")
    text: str = Field(description="the sampled tokens decoded, special tokens skipped")
    finish: Literal["stop", "length"]
    version: int = Field(ge=0, description="the weight version that sampled it")
    reused: int = Field(0, ge=0, description="prompt positions taken from the kept session")
    pad_id: int = Field(0, description="the generator's pad token (training rows pad with it)")
