"""The remote launcher: one ``hybridflow role`` per group, run through the cluster's ``via``
(here ``sh -c`` stands for ssh, which ``tests/deploy/test_cluster_restart.py`` runs for real):
the token travels on stdin, never on the command line; the launcher says which process leads
the group, a restart ends that process's whole session before the next starts, and a stop
leaves nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.placement import GroupSpec, RoleSpec
from deploy.clusters import RemoteCluster
from deploy.launchers.base import Launcher, session_alive
from deploy.launchers.remote import RemoteLauncher
from transport.settings import Timeouts


def test_a_group_is_one_process_through_via_restarted_as_a_whole_session(tmp_path: Path) -> None:
    deaths: list[tuple[str, int | None, str]] = []
    cluster = RemoteCluster(kind="remote", via=["sh", "-c"])
    group = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")})

    async def main() -> tuple[list[int | None], str]:
        launcher: Launcher = RemoteLauncher(
            "far", cluster, tmp_path, None, Timeouts(shutdown_s=0.5),
            lambda *death: deaths.append(death), "tcp://127.0.0.1:9", "secret-token",
        )  # fmt: skip
        launcher.start([group])
        pids = [w.pid for w in launcher.where()]
        await launcher.restart(group)
        pids += [w.pid for w in launcher.where()]
        await launcher.stop()
        assert isinstance(launcher, RemoteLauncher)
        return pids, launcher.command_line(group, "tcp://127.0.0.1:9")

    (first, second), line = asyncio.run(main())
    assert first is not None and second is not None and first != second
    assert not session_alive(first) and not session_alive(second)  # nothing of either is left
    assert "--token -" in line and "secret-token" not in line  # the token went over stdin
    assert "--connect tcp://127.0.0.1:9" in line and "--group gen" in line
    assert deaths == []  # a restart's and the stop's ends are no deaths
