"""A local session: controller in this process, every group as child processes, torn down in order.

``async with local_session(groups) as controller:`` binds the controller's ipc socket, starts each
group's ranks, waits until all have registered and built their roles, and on the way out (normal
end, error, Ctrl-C, SIGTERM) tells the groups to stop and makes sure no rank outlives the session.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from controller.placement import GroupSpec
from controller.server import Controller
from deploy.local import LocalLauncher
from transport.settings import Timeouts
from transport.shm import sweep_dead


@asynccontextmanager
async def local_session(
    groups: list[GroupSpec],
    timeouts: Timeouts | None = None,
    run_dir: Path | None = None,
    bind: str | None = None,
) -> AsyncIterator[Controller]:
    """``bind`` overrides the controller's address (default: an ipc socket in a private
    directory); ``tcp://127.0.0.1:0`` exercises the TCP path with ZeroMQ heartbeats."""
    timeouts = timeouts or Timeouts()
    sweep_dead()  # what an earlier run killed with -9 left in /dev/shm
    sock_dir = Path(
        tempfile.mkdtemp(prefix="hf-")
    )  # short path: ipc names are limited to ~100 bytes
    run_dir = run_dir or sock_dir
    controller = Controller(groups, timeouts)
    launcher: LocalLauncher | None = None
    try:
        address = controller.bind(bind or f"ipc://{sock_dir}/controller")
        launcher = LocalLauncher(
            address, controller.token, run_dir, sock_dir, timeouts, controller.report_exit
        )
        controller.local_groups = {g.name for g in groups}
        for group in groups:
            launcher.start(group)
        await controller.wait_ready()
        yield controller
    finally:
        if launcher is not None:
            launcher.stopping = True  # exits from here on are the shutdown, not deaths
        await controller.shutdown()
        if launcher is not None:
            await launcher.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
