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

import shlex
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.placement import GroupSpec
from controller.server import Controller
from deploy.local import LocalLauncher
from transport.channel import split_tcp
from transport.errors import RegistrationError
from transport.security import CurveServer
from transport.settings import Timeouts
from transport.shm import sweep_dead

if TYPE_CHECKING:
    from deploy.clusters import ClusterSpec


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
    announce: Callable[[GroupSpec, str], None],
) -> AsyncIterator[Controller]:
    """One controller bound at ``spec.controller.bind`` (CURVE with ``spec.keys``); each group
    started on the cluster ``where`` names. A launch that fails part-way stops what it started;
    a group that never joins is named with its cluster's state (a SLURM job still pending)."""
    from deploy.cluster_launch import RemoteGroups, SlurmJob, client_env, role_argv
    from deploy.clusters import LocalCluster, ManualCluster, RemoteCluster, SlurmCluster
    from deploy.keys_cli import server_files

    sweep_dead()
    timeouts = timeouts.model_copy(update={"connect_s": spec.controller.wait})
    controller = Controller(groups, timeouts)
    by_name = {g.name: g for g in groups}
    launchers: list[Any] = []
    sock_dir = Path(tempfile.mkdtemp(prefix="hf-"))
    try:
        curve = CurveServer(*server_files(spec.keys)) if spec.keys is not None else None
        address = controller.bind(spec.controller.bind, curve)
        if spec.controller.connect is not None:
            host, port = split_tcp(spec.controller.connect)
            address = f"tcp://{host}:{port or split_tcp(address)[1]}"  # :0: the port bound
        dead = lambda g, r, c: controller.declare_dead(g, r, c, True)  # noqa: E731
        for cname, cluster in spec.clusters.items():
            mine = [by_name[g] for g, c in where.items() if c == cname]
            if not mine:
                continue
            if isinstance(cluster, LocalCluster):
                local = LocalLauncher(
                    address, controller.token, run_dir, sock_dir, timeouts, controller.report_exit
                )
                launchers.append(local)
                controller.local_groups |= {g.name for g in mine}
                for group in mine:
                    local.start(group, client_env(spec.keys, group.name))
            elif isinstance(cluster, RemoteCluster):
                remote = RemoteGroups(cname, cluster, run_dir, spec.keys, timeouts, dead)
                launchers.append(remote)
                for group in mine:
                    remote.start(group, address, controller.token)
            elif isinstance(cluster, SlurmCluster):
                job = SlurmJob(cname, cluster, mine, run_dir, spec.keys, timeouts, dead)
                launchers.append(job)
                job.submit(address, controller.token)
            else:
                assert isinstance(cluster, ManualCluster)
                for group in mine:
                    keys = str(spec.keys) if spec.keys is not None else None
                    argv = role_argv(group, address, None, keys)
                    announce(
                        group, f"HYBRIDFLOW_TOKEN={controller.token} hybridflow {shlex.join(argv)}"
                    )
        try:
            await controller.wait_ready()
        except RegistrationError as exc:
            hints = [j.hint() for j in launchers if isinstance(j, SlurmJob)]
            raise RegistrationError("; ".join([str(exc), *hints])) from exc
        yield controller
    finally:
        for launcher in launchers:
            launcher.stopping = True  # exits from here on are the shutdown, not deaths
        await controller.shutdown()
        for launcher in launchers:
            await launcher.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
