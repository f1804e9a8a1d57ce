"""The ``hybridflow`` CLI as a user runs it: the demo job, and teardown under signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.commands.role import RoleOptions, _group_spec
from deploy.launchers.local import SOCKET_PREFIX
from tests.roles.test_mesh import pid_alive
from tests.waiting import wait_for, waits


def rank_pids(parent: int) -> list[int]:
    """Rank processes started by ``parent``: its descendants that call themselves ranks (its
    fork server's children, or its own when ranks start as their own interpreters)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
    found = []
    for pid in map(int, out.stdout.split()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        found += [pid] if b"roles.runtime" in title else rank_pids(pid)
    return found


def accepted(socket_path: Path) -> bool:
    """Whether a process has connected to the unix socket bound at ``socket_path``: the kernel
    lists each accepted connection under the listener's path, in state 03 (connected)."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(len(row) == 8 and row[7] == str(socket_path) and row[5] == "03" for row in rows)


def test_demo_trains_the_linear_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "--json", "--steps", "40"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["final_loss"] < 0.01 * result["first_loss"]
    assert result["weight_error"] < 0.05
    assert result["replicas_agree"] is True


# A demo step blocks each rank's main thread about 5 times (waiting for the call, for each
# all-reduce); the whole start-up of a rank blocks it about 20 times, only a few after it joined.
TRAINING_WAITS = 200


def _until_training(proc: subprocess.Popen[bytes], tmp: Path) -> list[int]:
    """The demo's rank pids once it is well into training: its two ranks started, the group
    joined the controller (its coordinator connected to the controller's socket, in ``tmp``),
    and both ranks computing steps."""

    def both_ranks() -> list[int] | None:
        found = rank_pids(proc.pid)
        return found if len(found) == 2 else None

    pids = wait_for(both_ranks, 30, "the demo's two rank processes", proc=proc)
    sockets = wait_for(
        lambda: list(tmp.glob(f"{SOCKET_PREFIX}*/controller")), 30, "the controller's socket"
    )
    wait_for(lambda: accepted(sockets[0]), 60, "the group joining the controller", proc=proc)
    joined = [waits(p) for p in pids]
    wait_for(
        lambda: all(waits(p) - n >= TRAINING_WAITS for p, n in zip(pids, joined, strict=True)),
        60,
        f"both ranks training (their main threads blocked {TRAINING_WAITS} times since)",
        proc=proc,
    )
    return pids


@pytest.fixture
def long_demo() -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    tmp = Path(tempfile.mkdtemp(prefix="hfcli"))  # short: ipc paths are limited to ~100 bytes
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "demo", "--steps", "1000000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp)},  # its socket folder goes there
    )
    pids = rank_pids(proc.pid)
    try:
        pids = _until_training(proc, tmp)
        yield proc, pids
    finally:  # whatever the test saw, leave nothing running
        pids = pids or rank_pids(proc.pid)
        proc.kill()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_ends_everything(
    sig: signal.Signals, long_demo: tuple[subprocess.Popen[bytes], list[int]]
) -> None:
    proc, pids = long_demo
    proc.send_signal(sig)
    assert proc.wait(timeout=20) == 130
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "every rank gone after the signal")


def test_kill_9_of_the_controller_leaves_no_orphans(
    long_demo: tuple[subprocess.Popen[bytes], list[int]],
) -> None:
    proc, pids = long_demo
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 5, "every rank gone after their parent")


def test_role_command_options_reach_the_group_it_launches() -> None:
    """``hybridflow role`` with its own ranks sizes the group from its options: every one of them,
    the fan-out backend included (it was once dropped, so ranks always used socket links)."""
    argv = "role actor,reward --connect tcp://127.0.0.1:5555 --nproc 4 --tp 2 --fanout zmq"
    args = build_parser().parse_args([*argv.split(), "--device", "cpu"])
    spec = _group_spec(RoleOptions.from_args(args))
    assert (spec.name, sorted(spec.roles), spec.nproc, spec.tp, spec.fanout, spec.device) == (
        "actor+reward",
        ["actor", "reward"],
        4,
        2,
        "zmq",
        "cpu",
    )


def test_an_error_quoting_brackets_is_printed_as_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Errors quote paths such as gloo's ``[/.../pair.cc:553]`` (a rank's collective failing
    mid-run); printed through rich markup unescaped, that raised a MarkupError instead and hid
    the error. A command that fails that way stands in for the run."""
    from deploy import cli
    from deploy.terminal import console

    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"

    def failing_report(args: object) -> int:
        raise RuntimeError(f"rank 1: {gloo}")

    monkeypatch.setattr(cli, "report_command", failing_report)
    # the console writes to the captured stderr; restored to None (follow sys.stderr) after
    monkeypatch.setattr(console, "_file", sys.stderr)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "anywhere"])
    assert exit_info.value.code == 1
    assert f"error: rank 1: {gloo}" in " ".join(capsys.readouterr().err.split())


def test_a_failed_run_prints_its_cause_with_brackets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hybridflow run``'s failure line: the cause is a remote error quoting gloo's source path."""
    from deploy.commands.run import RunOptions, _say_failed
    from deploy.terminal import console

    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"
    monkeypatch.setattr(console, "_file", sys.stderr)  # restored to None after
    _say_failed(RunOptions(), tmp_path, RuntimeError(f"rank 1: {gloo}"))
    printed = " ".join(capsys.readouterr().err.split())
    assert f"hybridflow run failed: RuntimeError: rank 1: {gloo}" in printed
