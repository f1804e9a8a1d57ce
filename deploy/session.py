"""Sessions: a controller bound and every placed group registered, torn down in order.

``local_session``: every group as child processes of this one. ``remote_session``: the groups
are started elsewhere (``hybridflow role ... --connect ADDR``, by hand, torchrun or srun) and
join over TCP; this process only binds and waits for them. ``cluster_session``: each group on the
cluster a cluster spec names (``deploy/clusters.py``), started from here.

``async with local_session(groups) as controller:`` binds the controller's ipc socket, starts each
group's ranks, waits until all have registered and built their roles, and on the way out (normal
end, error, Ctrl-C, SIGTERM) tells the groups to stop and makes sure no rank outlives the session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from controller.placement import GroupSpec
from controller.server import Controller
from controller.supervisor import Relaunch, Supervisor
from deploy.clusters import (
    AnyCluster,
    ClusterSpec,
    LocalCluster,
    ManualCluster,
    RayCluster,
    RemoteCluster,
    SlurmCluster,
)
from deploy.commands.keys import server_files
from deploy.launchers.base import Launcher
from deploy.launchers.local import LocalLauncher, SocketFolder, sweep_socket_folders
from deploy.launchers.manual import Announce, ManualLauncher
from deploy.launchers.remote import RemoteLauncher
from deploy.launchers.slurm import SlurmLauncher
from transport.channel import split_tcp
from transport.errors import RegistrationError
from transport.security import CurveServer
from transport.settings import Timeouts
from transport.shm import sweep_dead

log = logging.getLogger("hybridflow.session")


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
    sweep_socket_folders()  # ... and in /tmp
    folder = SocketFolder()  # short path: ipc names are limited to ~100 bytes
    sock_dir = folder.path
    run_dir = run_dir or sock_dir
    controller = Controller(groups, timeouts)
    launcher: LocalLauncher | None = None
    try:
        address = controller.bind(bind or f"ipc://{sock_dir}/controller")
        launcher = LocalLauncher(
            address, controller.token, run_dir, sock_dir, timeouts, controller.report_exit
        )
        Supervisor(controller, {g.name: launcher.restart for g in groups})
        controller.local_groups = {g.name for g in groups}
        launcher.start(groups)
        await controller.wait_ready()
        yield controller
    finally:
        if launcher is not None:
            launcher.stopping = True  # exits from here on are the shutdown, not deaths
        await controller.shutdown()
        if launcher is not None:
            await launcher.stop()
        folder.remove()


@asynccontextmanager
async def remote_session(
    groups: list[GroupSpec],
    bind: str,
    timeouts: Timeouts | None = None,
    announce: Callable[[str, str], None] | None = None,
    token: str | None = None,
    curve: CurveServer | None = None,
) -> AsyncIterator[Controller]:
    """Bind ``bind`` (e.g. ``tcp://0.0.0.0:5555``), call ``announce(address, token)`` so the
    groups can be started, wait ``timeouts.connect_s`` for all of them (the error lists who is
    missing), yield; on the way out tell every group to stop."""
    controller = Controller(groups, timeouts or Timeouts(), token=token)
    try:
        address = controller.bind(bind, curve)
        if announce is not None:
            announce(address, controller.token)
        Supervisor(controller, announce=_rejoin)  # groups started by hand are waited for
        try:
            await controller.wait_ready()
        except RegistrationError as exc:
            missing = [n for n, g in controller.groups.items() if not g.ready.is_set()]
            if not missing:
                raise
            raise RegistrationError(
                f"groups {missing} did not join {address} within "
                f"{controller.timeouts.connect_s:.0f} s; start them with the commands printed "
                "above, or wait longer (hybridflow controller --wait SECONDS)"
            ) from exc
        yield controller
    finally:
        await controller.shutdown()


@asynccontextmanager
async def cluster_session(
    groups: list[GroupSpec],
    spec: ClusterSpec,
    where: dict[str, str],
    run_dir: Path,
    timeouts: Timeouts,
    announce: Announce,
) -> AsyncIterator[Controller]:
    """One controller bound at ``spec.controller.bind`` (CURVE with ``spec.keys``); each group
    started on the cluster ``where`` names. A launch that fails part-way stops what it started;
    a group that never joins is named with its cluster's state (a SLURM job still pending)."""
    sweep_dead()
    sweep_socket_folders()
    timeouts = timeouts.model_copy(update={"connect_s": spec.controller.wait})
    controller = Controller(groups, timeouts)
    supervisor = Supervisor(controller, announce=_rejoin)
    by_name = {g.name: g for g in groups}
    launchers: list[Launcher] = []
    folder = SocketFolder()
    sock_dir = folder.path
    try:
        start = _ClusterStart(
            controller, _bind(controller, spec), spec, run_dir, sock_dir, announce
        )
        for cname, cluster in spec.clusters.items():
            mine = [by_name[g] for g, c in where.items() if c == cname]
            if mine:
                start.launch(cname, cluster, mine, launchers)
                supervisor.relaunch.update(start.relaunch)
        try:
            await controller.wait_ready()
        except RegistrationError as exc:
            hints = [j.hint() for j in launchers if isinstance(j, SlurmLauncher)]
            raise RegistrationError("; ".join([str(exc), *hints])) from exc
        yield controller
    finally:
        for launcher in launchers:
            launcher.stopping = True  # exits from here on are the shutdown, not deaths
        await controller.shutdown()
        try:
            await stop_all(launchers)
        finally:
            folder.remove()


async def stop_all(launchers: Sequence[Launcher]) -> None:
    """Stop every cluster's launcher, each whatever the others do (one whose ``stop`` failed
    must not leave another's jobs queued or processes running); then one error naming each
    that failed."""
    results = await asyncio.gather(*(j.stop() for j in launchers), return_exceptions=True)
    failed = [
        f"{type(j).__name__}: {r!r}"
        for j, r in zip(launchers, results, strict=True)
        if isinstance(r, BaseException)
    ]
    for line in failed:
        log.error("stopping a cluster's groups failed: %s", line)
    if failed:
        raise RuntimeError(f"stopping {len(failed)} cluster(s) failed: {'; '.join(failed)}")


def _rejoin(group: GroupSpec) -> None:
    log.warning(
        "waiting for group %r to register again (its process manager or operator starts it "
        "with the same command and token)",
        group.name,
    )


def _bind(controller: Controller, spec: ClusterSpec) -> str:
    """Bind the controller; the address groups dial (``controller.connect`` when given)."""
    curve = CurveServer(*server_files(spec.keys)) if spec.keys is not None else None
    address = controller.bind(spec.controller.bind, curve)
    if spec.controller.connect is not None:
        host, port = split_tcp(spec.controller.connect)
        address = f"tcp://{host}:{port or split_tcp(address)[1]}"  # :0: the port bound
    return address


@dataclass
class _ClusterStart:
    """What starting a cluster's groups needs: the controller, the address its groups dial."""

    controller: Controller
    address: str
    spec: ClusterSpec
    run_dir: Path
    sock_dir: Path
    announce: Announce
    relaunch: dict[str, Relaunch] = field(default_factory=dict)  # group -> its launcher's restart

    def dead(self, group: str, rank: int | None, cause: str) -> None:
        self.controller.declare_dead(group, rank, cause, True)

    def launch(
        self, name: str, cluster: AnyCluster, mine: list[GroupSpec], launchers: list[Launcher]
    ) -> None:
        """Start ``mine`` on ``cluster``; its launcher joins ``launchers`` before anything
        starts, so a launch that fails part-way is still stopped."""
        controller, keys, timeouts = self.controller, self.spec.keys, self.controller.timeouts
        address, token = self.address, controller.token
        launcher: Launcher
        if isinstance(cluster, LocalCluster):
            launcher = LocalLauncher(
                address, token, self.run_dir, self.sock_dir, timeouts, controller.report_exit, keys
            )
            controller.local_groups |= {g.name for g in mine}
        elif isinstance(cluster, RemoteCluster):
            launcher = RemoteLauncher(
                name, cluster, self.run_dir, keys, timeouts, self.dead, address, token
            )
        elif isinstance(cluster, SlurmCluster):
            launcher = SlurmLauncher(
                name, cluster, self.run_dir, keys, timeouts, self.dead, address, token
            )
        elif isinstance(cluster, RayCluster):
            from deploy.launchers.ray import RayLauncher  # ray is an extra: imported when used

            launcher = RayLauncher(
                name, cluster, self.run_dir, keys, timeouts, self.dead, address, token
            )
        else:
            assert isinstance(cluster, ManualCluster)
            launcher = ManualLauncher(address, token, keys, self.announce)
        launchers.append(launcher)
        launcher.start(mine)
        self.relaunch.update({group.name: launcher.restart for group in mine})
