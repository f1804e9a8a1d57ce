"""The local launcher: it says where each rank runs, restarts a group with new processes and
leaves none behind; rank logs are appended to across runs and the error it reports when a rank
dies comes from this run's part of the log, never from an earlier run's."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from controller.placement import GroupSpec, RoleSpec
from deploy.commands.role import _say_failed
from deploy.launchers.base import Launcher, Where, begin_log, last_error
from deploy.launchers.local import LocalLauncher
from deploy.processes import alive
from transport.device import DeviceKind
from transport.settings import Timeouts

OLD = "RuntimeError: the controller of an EARLIER run went away\n"


def test_last_error_reads_from_this_runs_start(tmp_path: Path) -> None:
    log = tmp_path / "g-0.log"
    log.write_text("starting\n" + OLD)
    start = begin_log(log)
    assert last_error(log) == OLD.strip()  # the whole file: the earlier run's error
    assert last_error(log, start) == "it printed nothing in this run"
    with open(log, "a") as out:  # the rank's first line says which process it is, not why
        out.write("hybridflow g:0 (r): pid 12, launched by pid 11\n")
    assert last_error(log, start) == "it printed nothing in this run"
    with open(log, "a") as out:
        out.write("loading\nValueError: this run's reason\nbye\n")
    assert last_error(log, start) == "ValueError: this run's reason"
    assert OLD in log.read_text()  # the earlier run's lines are kept for reading


def test_a_rank_that_dies_silently_is_not_explained_by_an_earlier_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "g-0.log").write_text(OLD)  # what an earlier `hybridflow role` run left

    async def main() -> list[tuple[int, int]]:
        failed: list[tuple[int, int]] = []
        done = asyncio.Event()

        def on_exit(group: str, rank: int, code: int, said: str) -> None:
            failed.append((rank, code))
            done.set()

        spec = GroupSpec.model_construct(
            name="g", roles={"r": RoleSpec(cls="unset:Unset")}, nproc=1, tp=1, pp=1,
            device=DeviceKind.CPU, fanout="socket",
        )  # fmt: skip
        launcher = LocalLauncher("ipc:///nowhere", "", tmp_path, tmp_path, Timeouts(), on_exit)
        launcher.start([spec])
        # dies before printing a reason (as after kill -9), before or after its start line
        launcher.procs[0].popen.kill()
        try:
            await asyncio.wait_for(done.wait(), 30)
        finally:
            await launcher.stop()
        _say_failed("g", launcher, failed)
        return failed

    assert asyncio.run(main()) == [(0, -9)]
    err = capsys.readouterr().err
    assert "rank 0 (-9) exited: it printed nothing in this run" in err
    assert "EARLIER" not in err


def test_a_rank_that_raises_is_reported_with_its_error_line(tmp_path: Path) -> None:
    """The launcher hands the controller the rank's last error line with its exit code, so the
    error a caller sees says why, not only ``exited with code 1``."""

    async def main() -> list[tuple[str, int, int, str]]:
        ended: list[tuple[str, int, int, str]] = []
        done = asyncio.Event()

        def on_exit(group: str, rank: int, code: int, said: str) -> None:
            ended.append((group, rank, code, said))
            done.set()

        spec = GroupSpec.model_construct(
            name="g", roles={"r": RoleSpec(cls="unset:Unset")}, nproc=1, tp=1, pp=1,
            device=DeviceKind.CPU, fanout="socket",
        )  # fmt: skip
        launcher = LocalLauncher("nonsense://x", "", tmp_path, tmp_path, Timeouts(), on_exit)
        launcher.start([spec])
        try:
            await asyncio.wait_for(done.wait(), 60)
        finally:
            await launcher.stop()
        return ended

    ((group, rank, code, said),) = asyncio.run(main())
    assert (group, rank, code) == ("g", 0, 1)
    assert said.startswith("zmq.error.ZMQError: Protocol not supported") and "nonsense://x" in said


def test_it_says_where_each_rank_runs_restarts_a_group_and_leaves_nothing(tmp_path: Path) -> None:
    """Through the launcher interface alone (``deploy/launchers/base.py``): two ranks that never
    reach a controller (none listens) are started, found, restarted and stopped."""
    exits: list[int] = []

    async def main() -> tuple[list[Where], list[Where], bool]:
        spec = GroupSpec.model_construct(
            name="g", roles={"r": RoleSpec(cls="unset:Unset")}, nproc=2, tp=1, pp=1,
            device=DeviceKind.CPU, fanout="socket", restart=None,
        )  # fmt: skip
        timeouts = Timeouts(shutdown_s=0.5)
        launcher: Launcher = LocalLauncher(
            f"ipc://{tmp_path}/nobody", "", tmp_path, tmp_path, timeouts,
            lambda g, r, code, said: exits.append(code),
        )  # fmt: skip
        launcher.start([spec])
        first = launcher.where()
        await launcher.restart(spec)
        second = launcher.where()
        await launcher.stop()
        return first, second, any(alive(w.pid or 0) for w in first + second)

    first, second, left = asyncio.run(main())
    host = socket.gethostname()
    assert [(w.group, w.rank, w.host) for w in first] == [("g", 0, host), ("g", 1, host)]
    assert [(w.group, w.rank) for w in second] == [("g", 0), ("g", 1)]
    assert {w.pid for w in first}.isdisjoint({w.pid for w in second})  # new processes
    assert not left and exits == []  # a restart's and the stop's ends are no deaths
    written = json.loads((tmp_path / "processes.json").read_text())
    assert [r["pid"] for r in written["ranks"]] == [w.pid for w in second]
