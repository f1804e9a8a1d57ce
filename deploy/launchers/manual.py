"""The ``manual`` launcher: nothing is started from here. The command that starts each group
(``hybridflow role ... --connect ADDR``, the token in its environment) is handed to ``announce``,
which prints it; an operator, a process manager or a scheduler of their own runs it. A group the
supervisor restarts is announced again: the same command brings it back."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from controller.placement import GroupSpec
from deploy.launchers.base import Where, role_argv

log = logging.getLogger("hybridflow.session")

Announce = Callable[[GroupSpec, str], None]  # a group, the command that starts it by hand


class ManualLauncher:
    def __init__(self, address: str, token: str, keys: Path | None, announce: Announce) -> None:
        self.address, self.token, self.keys, self.announce = address, token, keys, announce
        self.groups: dict[str, GroupSpec] = {}
        self.stopping = False

    def command(self, group: GroupSpec) -> str:
        keys = str(self.keys) if self.keys is not None else None
        argv = role_argv(group, self.address, None, keys)
        return f"HYBRIDFLOW_TOKEN={self.token} hybridflow {shlex.join(argv)}"

    def start(self, groups: Sequence[GroupSpec]) -> None:
        for group in groups:
            self.groups[group.name] = group
            self.announce(group, self.command(group))

    async def restart(self, spec: GroupSpec) -> None:
        log.warning(
            "waiting for group %r to register again (its process manager or operator starts it "
            "with the same command)",
            spec.name,
        )
        self.announce(spec, self.command(spec))

    async def stop(self) -> None:
        """The groups leave on the controller's SHUTDOWN; nothing here to end."""
        self.stopping = True

    def where(self) -> list[Where]:
        return [Where(name, None, "started by hand") for name in self.groups]
