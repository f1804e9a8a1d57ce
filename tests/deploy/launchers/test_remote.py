"""The remote launcher: one ``hybridflow role`` per group, run through the cluster's ``via``
(here ``sh -c`` stands for ssh, which ``tests/deploy/test_netns.py`` runs for real), or, over
several hosts, a process a rank: the token travels on stdin, never on the command line; the
launcher says which process leads the group or runs each rank where, a restart ends those
processes' whole sessions before the next start, and a stop leaves nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.placement import GroupSpec, RoleSpec
from deploy.clusters import RemoteCluster, RemoteHost
from deploy.launchers.base import Launcher, Where, session_alive
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


def test_a_group_over_two_hosts_is_a_process_a_rank_meeting_on_the_first(tmp_path: Path) -> None:
    """``hosts``: a group over 2 hosts of 2 ranks each runs each rank through its host's
    ``via`` with torchrun's variables, and all meet at the first host's address on a port that
    host called free; a one-node group goes to the next host as one ``hybridflow role``; a
    restart starts the ranks again where they were."""
    deaths: list[tuple[str, int | None, str]] = []
    said = [tmp_path / "at-a", tmp_path / "at-b"]  # the command lines each host was given
    # each host runs what it is given (the port probe), except that a ``hybridflow`` command
    # line is only written down, and its stdin (the token) read and dropped
    record = 'case "$0" in *deploy.cli*) echo "$0" >> {}; exec cat >/dev/null;; esac; eval "$0"'
    hosts = [
        RemoteHost(via=["sh", "-c", record.format(path)], address=address)
        for path, address in zip(said, ("127.0.0.1", "127.0.0.2"), strict=True)
    ]
    cluster = RemoteCluster(kind="remote", hosts=hosts)
    wide = GroupSpec(name="main", roles={"actor": RoleSpec(cls="a:B")}, nproc=4, nodes=2)
    narrow = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")})

    async def main() -> tuple[list[Where], list[Where]]:
        launcher = RemoteLauncher(
            "pair", cluster, tmp_path, None, Timeouts(shutdown_s=0.5),
            lambda *death: deaths.append(death), "tcp://127.0.0.1:9", "secret-token",
        )  # fmt: skip
        launcher.start([wide, narrow])
        first = launcher.where()
        await launcher.restart(wide)
        again = launcher.where()
        await launcher.stop()
        return first, again

    first, again = asyncio.run(main())
    assert [(w.group, w.rank, w.host) for w in first] == [
        ("main", 0, "127.0.0.1"),
        ("main", 1, "127.0.0.1"),
        ("main", 2, "127.0.0.2"),
        ("main", 3, "127.0.0.2"),
        ("gen", None, "127.0.0.1"),  # the host after main's two: round robin, host 0 again
    ]
    lines = [path.read_text().splitlines() for path in said]
    assert len(lines[0]) == 2 + 1 + 2 and len(lines[1]) == 2 + 2  # main twice, gen once
    ports = set()
    for line in [*lines[0], *lines[1]]:
        assert "--token -" in line and "secret-token" not in line
        if "--group main" in line:
            rank = int(line.split("RANK=")[1].split()[0])
            assert f"WORLD_SIZE=4 LOCAL_RANK={rank % 2}" in line
            assert (rank >= 2) == (line in lines[1])  # ranks 2 and 3 on the second host
            assert "--launcher env --master-addr 127.0.0.1 --master-port " in line
            ports.add(line.split("--master-port ")[1].split()[0])
        else:
            assert "RANK=" not in line and "--nproc 1" in line and "--launcher" not in line
    assert len(ports) == 2  # the first start's and the restart's, each asked of host 0
    assert {w.pid for w in again if w.group == "main"}.isdisjoint(w.pid for w in first)
    assert all(not session_alive(w.pid) for w in [*first, *again] if w.pid is not None)
    assert deaths == []
