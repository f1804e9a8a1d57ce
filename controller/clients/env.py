"""Client of the env role (``roles/env.py``): the tools or environment of multi-turn rollouts.

A multi-turn rollout asks ``spec()`` once, ``open``s a session per trajectory, ``submit``s each
turn that holds a call (or, for an environment, every turn) and ``collect``s finished results in a
loop, then ``close``s the sessions. ``submit`` returns at once; the actions run on the env group's
workers while it takes more. Calls to the group run one at a time, so a ``collect`` that waits
holds back the next ``submit``: collect with a short ``wait_s``, and give the call a ``timeout``
above it when ``timeouts.call_s`` is not.
"""

from __future__ import annotations

from controller.clients.base import RoleClient
from transport.agent import (
    AgentExchange,
    AgentReply,
    EnvAction,
    EnvOpen,
    EnvResult,
    EnvSpec,
)
from transport.protocol import Transfer


class EnvClient(RoleClient):
    """Tools or an environment for multi-turn rollouts: sessions, actions and observations."""

    async def spec(self, *, timeout: float | None = None) -> EnvSpec:
        """The tokens that end a turn, the tools' schemas and the call format."""
        return await self._call(Transfer.RANK_ZERO, "spec", timeout=timeout)

    async def open(
        self, sessions: list[EnvOpen], *, timeout: float | None = None
    ) -> list[EnvResult]:
        """A session per trajectory, from its data row; an environment's first observation."""
        return await self._call(Transfer.RANK_ZERO, "open", sessions, timeout=timeout)

    async def submit(self, actions: list[EnvAction], *, timeout: float | None = None) -> int:
        """Start the actions (returns at once: how many were accepted)."""
        return await self._call(Transfer.RANK_ZERO, "submit", actions, timeout=timeout)

    async def collect(self, wait_s: float, *, timeout: float | None = None) -> list[EnvResult]:
        """The actions finished since the last collect, waiting up to ``wait_s`` for the first
        (may be empty)."""
        return await self._call(Transfer.RANK_ZERO, "collect", wait_s, timeout=timeout)

    async def exchange(
        self, replies: list[AgentReply], wait_s: float, *, timeout: float | None = None
    ) -> AgentExchange:
        """Agent mode: the replies to the agents' model calls in; the calls waiting and the
        agents finished out (waiting up to ``wait_s`` for the first)."""
        return await self._call(Transfer.RANK_ZERO, "exchange", replies, wait_s, timeout=timeout)

    async def close(self, sessions: list[int], *, timeout: float | None = None) -> int:
        """Drop sessions; how many were open."""
        return await self._call(Transfer.RANK_ZERO, "close", sessions, timeout=timeout)
