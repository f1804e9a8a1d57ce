"""``hybridflow role``, as a person runs it from the command a controller prints: it says when its
group joined, what it runs and how it ended (exit status and reason), writes its rank logs where
``--run-dir`` says, and leaves no socket file behind — after a clean run, a refusal, or the
controller killed under it. Real processes: a controller alone, and groups started by hand."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]
SHORT = ["--set", "stages.0.steps=8", "--set", "stages.1.steps=2"]  # a whole run, small


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def flat(path: Path) -> str:
    """A log as one line (a terminal may wrap what a pipe keeps whole)."""
    return " ".join(read(path).split())


def start_controller(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], list[str], str]:
    """A controller alone on loopback TCP; its process, the printed role arguments and token."""
    tmp_path.mkdir(exist_ok=True)
    err = tmp_path / "controller.err"
    argv = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", *extra]
    argv += ["--bind", "tcp://127.0.0.1:0", "--run-dir", str(tmp_path / "run"), "--json"]
    with err.open("w") as stderr:
        ctl = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=stderr, text=True)
    printed = wait_for(
        lambda: re.search(r"HYBRIDFLOW_TOKEN=(\w+) hybridflow role (.+)\n", read(err)),
        90,
        "the controller's role command",
        proc=ctl,
        detail=lambda: read(err),
    )
    return ctl, printed.group(2).split(), printed.group(1)


def start_role(
    tmp_path: Path, name: str, args: list[str], token: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """``hybridflow role ARGS`` with its own socket folder and run dir; stderr to a file."""
    sockets = tmp_path / f"{name}-sockets"
    sockets.mkdir()
    err = tmp_path / f"{name}.err"
    argv = [*args, "--socket-dir", str(sockets), "--run-dir", str(tmp_path / name)]
    with err.open("w") as stderr:
        role = subprocess.Popen(
            [*CLI, "role", *argv],
            env={**os.environ, "HYBRIDFLOW_TOKEN": token},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    return role, err


def stop(*procs: subprocess.Popen[str] | subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_says_it_joined_what_it_runs_and_that_it_ended(tmp_path: Path) -> None:
    """The token goes by file here (``--token-file`` on both sides), not scraped from stderr."""
    token_file = tmp_path / "token"
    ctl, args, token = start_controller(tmp_path, *SHORT, "--token-file", str(token_file))
    assert token_file.read_text() == f"{token}\n"
    assert token_file.stat().st_mode & 0o777 == 0o600
    role = None
    try:
        role, err = start_role(tmp_path, "main", [*args, "--token-file", str(token_file)], "")
        assert role.wait(240) == 0, read(err)
        ctl.wait(60)
    finally:
        stop(ctl, role)
    assert ctl.returncode == 0
    assert list((tmp_path / "main-sockets").iterdir()) == []  # no .fan file left
    said = flat(err)
    logs = (tmp_path / "main" / "logs").resolve()
    assert f"rank logs: {logs}/main-<rank>.log" in said
    assert re.search(
        r"group main joined the controller at tcp://127\.0\.0\.1:\d+: roles actor, reward on 2 "
        r"ranks \(dp 2 x tp 1 x pp 1\), device cpu",
        said,
    ), said
    assert "group main ended: the controller shut the group down (run over) (exit 0)" in said
    assert sorted(p.name for p in logs.iterdir()) == ["main-0.log", "main-1.log"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_refused_group_and_one_whose_controller_is_killed_say_why_and_clean_up(
    tmp_path: Path,
) -> None:
    """The group started at another size than placed is refused, says why, and the controller
    stops waiting at once (not after its --wait of 120 s), naming it; then a second controller,
    whose group joined, is killed under it."""
    first, args, token = start_controller(tmp_path / "first")
    ctl = refused = joined = None
    try:
        wrong = [*args[: args.index("--nproc")], "--nproc", "1"]  # the placement says 2
        wrong += args[args.index("--nproc") + 2 :]
        refused, refused_err = start_role(tmp_path, "refused", wrong, token)
        assert refused.wait(120) == 1, read(refused_err)
        assert list((tmp_path / "refused-sockets").iterdir()) == []
        said = flat(refused_err)
        refusal = "group main ended: rank 0 (1) exited: RegistrationError: the controller refused"
        assert f"{refusal} group 'main': world size 1 but the placement says nproc=2" in said
        assert said.endswith("(exit 1) rank logs: " + str((tmp_path / "refused/logs").resolve()))
        assert first.wait(60) != 0  # within a minute of a --wait of 120 s: the refusal ended it
        ended = flat(tmp_path / "first" / "controller.err")
        assert "group 'main' was refused: world size 1 but the placement says nproc=2" in ended

        ctl, args, token = start_controller(tmp_path)
        joined, joined_err = start_role(tmp_path, "joined", args, token)
        wait_for(
            lambda: "group main joined the controller" in read(joined_err),
            120,
            "the group's joined line",
            proc=joined,
            detail=lambda: read(joined_err),
        )
        assert ctl.poll() is None
        ctl.send_signal(signal.SIGKILL)
        assert joined.wait(120) == 1
    finally:
        stop(first, ctl, refused, joined)
    said = flat(joined_err)
    assert re.search(
        # whichever rank the launcher sees end first is named first (under load rank 1 may end
        # on its own broken link before rank 0 reports the lost controller); the reason is rank 0's
        r"group main ended: rank [01] \(1\)(, rank [01] \((1|-9)\))? exited: lost the controller at "
        r"tcp://127\.0\.0\.1:\d+ \(it exited or was killed\) \(exit 1\)",
        said,
    ), said
    assert list((tmp_path / "joined-sockets").iterdir()) == []
