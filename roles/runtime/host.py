"""The role host of one rank: the role instances it built and the endpoint table calls dispatch by.

Every group hosts the built-in ``GroupRole`` (set-up and health) next to the roles its placement
names; the controller builds the named ones through ``GroupRole.build``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from roles.base import RoleContext
from roles.runtime.device import RankDevice
from roles.runtime.endpoint import ONE_TO_ALL, EndpointSpec, endpoint, endpoints_of
from transport.imports import import_path
from transport.protocol import Layout

GROUP_ROLE = "_group"  # built-in role every group hosts: set-up and health


def load_class(path: str) -> type:
    """``package.module:Class`` → the class, with errors that say what is wrong."""
    found: type = import_path(path, "role class", "Class", lambda c: isinstance(c, type))
    return found


class GroupRole:
    """Built into every group: builds the placed roles on each rank."""

    def __init__(self, host: RoleHost) -> None:
        self.host = host

    @endpoint(ONE_TO_ALL)
    def build(self, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
        """Instantiate ``{role: {"cls": path, "config": {...}}}``; returns each role's endpoints
        and their transfer protocols."""
        return self.host.build(specs)

    @endpoint(ONE_TO_ALL)
    def ping(self) -> int:
        return self.host.rank


class RoleHost:
    """The role instances of one rank and the endpoint table the coordinator dispatches by."""

    def __init__(
        self,
        group: str,
        rank: int,
        layout: Layout,
        pg: dist.ProcessGroup | None,
        device: RankDevice,
    ) -> None:
        self.group = group
        self.rank = rank
        self.layout = layout
        self.pg = pg
        self.device = device
        self.instances: dict[str, Any] = {GROUP_ROLE: GroupRole(self)}
        self.endpoints: dict[str, dict[str, EndpointSpec]] = {GROUP_ROLE: endpoints_of(GroupRole)}

    def build(self, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
        for name, spec in specs.items():
            cls = load_class(spec["cls"])
            table = endpoints_of(cls)
            if not table:
                raise ValueError(f"role class {spec['cls']} declares no @endpoint methods")
            ctx = RoleContext(
                name,
                self.group,
                self.rank,
                self.layout.world_size,
                self.layout,
                self.pg,
                self.device,
            )
            self.instances[name] = cls(ctx, **spec.get("config", {}))
            self.endpoints[name] = table
        return {
            name: {m: s.protocol.name for m, s in table.items()}
            for name, table in self.endpoints.items()
            if name != GROUP_ROLE
        }

    def spec(self, role: str, method: str) -> EndpointSpec:
        table = self.endpoints.get(role)
        if table is None:
            raise KeyError(f"group {self.group!r} hosts no role {role!r}")
        found = table.get(method)
        if found is None:
            raise AttributeError(f"role {role!r} has no endpoint {method!r}")
        return found

    def run(self, role: str, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        self.spec(role, method)
        return getattr(self.instances[role], method)(*args, **kwargs)
