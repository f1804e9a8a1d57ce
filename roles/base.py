"""What every role sees of its process: rank, group, layout — and the role host that runs calls.

A role is a plain class whose constructor takes a ``RoleContext`` plus its own config keywords and
whose endpoints are marked with ``@endpoint``. The controller names the class by import path
(``package.module:Class``) in the placement, so which roles share a group is configuration.
``RoleHost`` holds the role instances of one rank and runs calls on them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from roles.endpoint import ONE_TO_ALL, EndpointSpec, endpoint, endpoints_of
from transport.protocol import Layout

GROUP_ROLE = "_group"  # built-in role every group hosts: set-up and health


@dataclass
class RoleContext:
    role: str
    group: str
    rank: int
    world_size: int
    layout: Layout
    process_group: dist.ProcessGroup | None

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]


class Role:
    """Base class of roles (optional: any class with endpoints and this constructor works)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx


def import_path(path: str, what: str, kind: str, check: Callable[[Any], bool]) -> Any:
    """``package.module:name`` → the object, or a ValueError saying what is wrong; ``what``
    names the setting (``role class``), ``kind`` the object (``class``), ``check`` accepts it."""
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"{what} {path!r} must look like package.module:{kind}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {what} {path!r}: {exc}") from exc
    found = getattr(module, attr, None)
    if not check(found):
        raise ValueError(f"{module_name} has no {kind} {attr!r} ({what} {path!r})")
    return found


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

    def __init__(self, group: str, rank: int, layout: Layout, pg: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = rank
        self.layout = layout
        self.pg = pg
        self.instances: dict[str, Any] = {GROUP_ROLE: GroupRole(self)}
        self.endpoints: dict[str, dict[str, EndpointSpec]] = {GROUP_ROLE: endpoints_of(GroupRole)}

    def build(self, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
        for name, spec in specs.items():
            cls = load_class(spec["cls"])
            table = endpoints_of(cls)
            if not table:
                raise ValueError(f"role class {spec['cls']} declares no @endpoint methods")
            ctx = RoleContext(
                name, self.group, self.rank, self.layout.world_size, self.layout, self.pg
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
