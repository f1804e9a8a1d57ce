"""``RoleClient``: how a controller program talks to one role, wherever its group runs.

``await client.call("method", *args)`` returns the collected result of the method run on the
role's ranks under the endpoint's transfer protocol. Calls to roles in different groups overlap
under ``asyncio.gather``; calls to colocated roles queue in order on the shared ranks. Typed
clients for specific roles subclass this and wrap ``call`` in real methods, so programs read like
``await actor.compute_log_prob(batch)`` and a type checker sees every call.
"""

from __future__ import annotations

from typing import Any

from controller.server import Controller


class RoleClient:
    def __init__(self, controller: Controller, role: str) -> None:
        controller.group_of(role)  # unknown role: fail now, not at the first call
        self.controller = controller
        self.role = role

    async def call(
        self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """Run ``method`` on the role. ``timeout`` (seconds) overrides ``timeouts.call_s`` and is
        therefore not passed on to the method."""
        return await self.controller.call(self.role, method, list(args), kwargs, timeout)

    @property
    def endpoints(self) -> dict[str, str]:
        """Endpoint name → transfer protocol, as the role's group reported them."""
        return dict(self.controller.group_of(self.role).endpoints.get(self.role, {}))

    def __repr__(self) -> str:
        return f"RoleClient({self.role!r})"
