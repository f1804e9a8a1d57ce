"""Placement: which roles share a process group, and how big each group is.

This is configuration, not code (the paper's resource pools). The controller uses it to accept or
refuse a group that registers and to tell each group which role classes to build; launchers use it
to start the right number of ranks. A role class is named by import path and is only ever
imported inside role processes — the controller never loads model code.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from transport.device import DeviceKind

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


class RoleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cls: str = Field(description="role class as package.module:Class")
    config: dict[str, Any] = Field(default_factory=dict, description="keyword arguments")

    @field_validator("cls")
    @classmethod
    def _import_path(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"cls={value!r} must look like package.module:Class")
        return value


class RestartPolicy(BaseModel):
    """How often the controller restarts a role group that died (``controller/supervisor.py``):
    at most ``max`` restarts within any ``window_s`` seconds, the n-th after ``backoff_s[n]``
    seconds (the last entry repeats). One restart more than that stops the run, as a death does
    without a policy."""

    model_config = ConfigDict(extra="forbid")

    max: int = Field(3, ge=0, description="restarts allowed within window_s (0: never restart)")
    window_s: float = Field(600.0, gt=0, description="the window max counts restarts in")
    backoff_s: list[float] = Field(
        default_factory=lambda: [1.0, 5.0, 30.0],
        min_length=1,
        description="seconds before the 1st, 2nd, ... restart within the window; the last repeats",
    )
    rejoin_s: float = Field(
        120.0,
        gt=0,
        description="how long a restarted group may take to register and build its roles "
        "(a group started by hand: for its process manager or operator to start it again)",
    )

    @field_validator("backoff_s")
    @classmethod
    def _not_negative(cls, value: list[float]) -> list[float]:
        if any(v < 0 for v in value):
            raise ValueError(f"backoff_s={value}: seconds cannot be negative")
        return value

    def backoff(self, restarts: int) -> float:
        """Seconds to wait before restart number ``restarts`` (0-based) of a window."""
        return self.backoff_s[min(restarts, len(self.backoff_s) - 1)]


class GroupSpec(BaseModel):
    """One process group and the roles it hosts (colocated roles run in sequence on its ranks)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    roles: dict[str, RoleSpec]
    nproc: int = Field(1, ge=1, description="ranks in the group")
    threads: int = Field(
        1, ge=1, description="intra-op threads of each rank (torch.set_num_threads, OpenMP)"
    )
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    gen_tp: int = Field(
        0, ge=0, description="tensor-parallel size while generating (reshard/); 0: as tp"
    )
    gen_pp: int = Field(0, ge=0, description="pipeline size while generating (reshard/); 0: as pp")
    nodes: int = Field(
        1,
        ge=1,
        description="nodes the ranks span, nproc / nodes a node, laid out node by node (rank r "
        "on node r // (nproc / nodes)): tensor-parallel peers share a node",
    )
    fanout: Literal["socket", "zmq", "rpc"] = Field(
        "socket", description="how rank 0 reaches the other ranks (python -m bench.transport)"
    )
    device: DeviceKind = Field(
        DeviceKind.CPU, description="where the ranks compute: cpu (gloo) or cuda (NCCL)"
    )
    restart: RestartPolicy | None = Field(
        None, description="restart the group when it dies (None: a death stops the run)"
    )
    stateful: bool = Field(
        True,
        description="its roles hold state training changed (weights, optimizer): restarting "
        "it rolls every stateful group back to the last checkpoint",
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"group name {value!r}: use letters, digits, '_' and '-'")
        return value

    @model_validator(mode="after")
    def _layout_fits(self) -> GroupSpec:
        if not self.roles:
            raise ValueError(f"group {self.name!r} hosts no roles")
        for role in self.roles:
            if not _NAME.match(role):
                raise ValueError(f"role name {role!r}: use letters, digits, '_' and '-'")
        if self.nproc % (self.tp * self.pp):
            raise ValueError(
                f"group {self.name!r}: tp={self.tp} x pp={self.pp} does not divide "
                f"nproc={self.nproc}; pick tp and pp whose product divides {self.nproc}"
            )
        if self.nproc % self.nodes:
            raise ValueError(
                f"group {self.name!r}: nodes={self.nodes} does not divide nproc={self.nproc}; "
                "every node of a group holds as many ranks"
            )
        if (self.nproc // self.nodes) % self.tp:
            raise ValueError(
                f"group {self.name!r}: tp={self.tp} does not divide a node's share of the group "
                f"(nproc={self.nproc} / nodes={self.nodes} = {self.nproc // self.nodes} a node); "
                "tensor-parallel peers must share a node"
            )
        if self.nodes > 1 and self.fanout == "rpc":
            raise ValueError(
                f"group {self.name!r}: fanout=rpc (torch rpc, unencrypted) cannot span nodes; "
                "use socket or zmq (links between nodes then go over CURVE)"
            )
        if self.gen_tp and self.tp % self.gen_tp:
            raise ValueError(
                f"group {self.name!r}: gen_tp={self.gen_tp} must divide tp={self.tp} (each "
                "generation shard is a union of training shards)"
            )
        if self.gen_pp and self.pp % self.gen_pp:
            raise ValueError(
                f"group {self.name!r}: gen_pp={self.gen_pp} must divide pp={self.pp} (each "
                "generation stage is a union of training stages)"
            )
        return self

    @property
    def dp(self) -> int:
        return self.nproc // (self.tp * self.pp)


def check_placement(groups: list[GroupSpec]) -> None:
    """Group names are unique and each role lives in exactly one group."""
    seen_groups: set[str] = set()
    owner: dict[str, str] = {}
    for group in groups:
        if group.name in seen_groups:
            raise ValueError(f"two groups are named {group.name!r}")
        seen_groups.add(group.name)
        for role in group.roles:
            if role in owner:
                raise ValueError(
                    f"role {role!r} is placed in both {owner[role]!r} and {group.name!r}"
                )
            owner[role] = group.name
