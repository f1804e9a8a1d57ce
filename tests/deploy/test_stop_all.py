"""A run over several clusters stops each cluster's groups whatever another's stop does: one
launcher whose ``stop`` fails (an unreachable login node, scancel missing) no longer leaves the
clusters after it running; every failure is named in one error."""

from __future__ import annotations

import asyncio

import pytest

from deploy.launchers.base import Launcher
from deploy.session import stop_all


class Stopping:
    """A launcher as far as stopping goes: its ``stop`` ends after the others started theirs,
    or fails with ``error``."""

    def __init__(self, error: Exception | None, started: list[str], name: str) -> None:
        self.error, self.started, self.name = error, started, name
        self.stopping = False
        self.stopped = False

    async def stop(self) -> None:
        self.started.append(self.name)
        await asyncio.sleep(0)  # the others run meanwhile
        if self.error is not None:
            raise self.error
        self.stopped = True


def test_every_cluster_is_stopped_and_every_failure_named() -> None:
    started: list[str] = []
    first = Stopping(RuntimeError("ssh: login.site1 unreachable"), started, "site1")
    second = Stopping(None, started, "site2")
    third = Stopping(FileNotFoundError("scancel"), started, "site3")
    launchers: list[Launcher] = [first, second, third]  # type: ignore[list-item]
    with pytest.raises(RuntimeError) as raised:
        asyncio.run(stop_all(launchers))
    assert sorted(started) == ["site1", "site2", "site3"] and second.stopped
    message = str(raised.value)
    assert message.startswith("stopping 2 cluster(s) failed: ")
    assert "login.site1 unreachable" in message and "scancel" in message
    asyncio.run(stop_all([second]))  # none failing: no error  # type: ignore[list-item]
