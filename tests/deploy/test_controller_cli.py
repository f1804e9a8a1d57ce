"""``hybridflow controller EXP --bind tcp://...``: the controller alone, its group started by hand
with the command it prints, a whole (quick) run over TCP; and a group that never comes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_for
from transport.channel import spare_port
from transport.security import load_public

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]
ANNOUNCED = r"HYBRIDFLOW_TOKEN=(\w+) hybridflow role (.+)\n"  # the command it prints


def wait_for_line(
    path: Path,
    pattern: str,
    proc: subprocess.Popen[str],
    limit: float,
    what: str,
    joined: bool = False,
) -> re.Match[str]:
    """``pattern`` found in the log ``path`` that ``proc`` writes; fails naming ``what``.
    ``joined``: in the log's lines joined, runs of whitespace made one space (log records are
    wrapped to the console's width)."""

    def found() -> re.Match[str] | None:
        text = path.read_text() if path.exists() else ""
        return re.search(pattern, " ".join(text.split()) if joined else text)

    return wait_for(found, limit, what, proc=proc, detail=path.read_text)


# extended: the default tier runs the printed command as it is on this host
# (tests/deploy/test_role_command.py: the group joins, the run completes, the group ends) and
# under torchrun over two hosts (tests/deploy/test_netns.py: the quick quickstart's 46 steps)
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["hybridflow", "torchrun"])
def test_controller_alone_and_a_group_started_by_hand(launcher: str, tmp_path: Path) -> None:
    """The group is started with the printed command (its ranks spawned by `hybridflow role`),
    or by torchrun, each of whose two processes becomes one rank."""
    run_dir, err = tmp_path / "run", tmp_path / "controller.err"
    argv = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--run-dir", str(run_dir)]
    with err.open("w") as stderr:
        ctl = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = wait_for_line(err, ANNOUNCED, ctl, 60, "the controller printing the role command")
        env = {**os.environ, "HYBRIDFLOW_TOKEN": line.group(1)}
        role_args = [*line.group(2).split(), "--run-dir", str(tmp_path / "role")]
        assert role_args[:2] == ["actor,reward", "--connect"]
        assert role_args[2].startswith("tcp://127.0.0.1:")
        command = [*CLI, "role", *role_args]
        if launcher == "torchrun":
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            command = [*torchrun, "--master-port", str(spare_port()), "-m", "deploy.cli", "role"]
            command += [*role_args[:3], "--group", "main"]
        role = subprocess.run(command, env=env, timeout=240)
        out, _ = ctl.communicate(timeout=60)
    finally:
        if ctl.poll() is None:
            ctl.kill()
    assert role.returncode == 0 and ctl.returncode == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 46 and summary["val_acc_after"] is not None
    assert (run_dir / "export" / "actor" / "model.safetensors").exists()


def test_a_group_that_never_joins_is_named(tmp_path: Path) -> None:
    argv = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", "--wait", "2"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "groups ['main'] did not join tcp://127.0.0.1:" in done.stderr
    assert "within 2 s" in done.stderr and "--wait" in done.stderr
    assert "--resume" not in done.stderr  # nothing to resume from


def host_address() -> str:
    """An address of this machine that is not loopback (the transport demands CURVE there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address: str = s.getsockname()[0]
    return address


BARE = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json", "--wait", "90"]


def test_a_bind_off_this_host_without_keys_is_refused(tmp_path: Path) -> None:
    host = host_address()
    assert not host.startswith("127.")
    refused = subprocess.run(
        [*CLI, *BARE, "--bind", f"tcp://{host}:0", "--run-dir", str(tmp_path / "bare")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "needs CURVE keys" in refused.stderr


# The CLI controller with keys and a group joining by hand with them run in the default tier in
# tests/deploy/test_netns.py (two hosts); a valid key not listed, refused: tests/transport/test_curve.py
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_curve_keys_admit_the_listed_group_and_refuse_another(tmp_path: Path) -> None:
    keys, run_dir, err = tmp_path / "keys", tmp_path / "run", tmp_path / "controller.err"
    made = subprocess.run([*CLI, "keys", str(keys), "--clients", "main,intruder"], check=True)
    assert made.returncode == 0 and (keys / "allowed" / "main.key").exists()
    (keys / "allowed" / "intruder.key").unlink()  # made, but not accepted
    host = host_address()
    bare = BARE
    argv = [*bare, "--bind", f"tcp://{host}:0", "--keys", str(keys), "--run-dir", str(run_dir)]
    with err.open("w") as stderr:
        ctl = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=stderr, text=True)
    intruder = None
    try:
        line = wait_for_line(err, ANNOUNCED, ctl, 60, "the controller printing the role command")
        env = {**os.environ, "HYBRIDFLOW_TOKEN": line.group(1)}
        args = line.group(2).split()
        assert args[-4:] == ["--keys", str(keys), "--client", "main"]
        wrong = [*args[:-1], "intruder", "--run-dir", str(tmp_path / "intruder")]
        intruder = subprocess.Popen([*CLI, "role", *wrong], env=env)
        # the intruder's handshake is refused, by its key, and logged; the controller keeps waiting
        refusal = (
            rf"refused a CURVE handshake from {re.escape(host)}(?::\d+)?: its key (\S+) is not"
        )
        seen = wait_for_line(err, refusal, ctl, 60, "the refusal of the intruder's key", True)
        assert seen.group(1) == load_public(keys / "intruder.key").decode()
        assert ctl.poll() is None and intruder.poll() is None
        good = [*args, "--run-dir", str(tmp_path / "role")]
        role = subprocess.run([*CLI, "role", *good], env=env, timeout=240)
        out, _ = ctl.communicate(timeout=60)
    finally:
        for proc in (ctl, intruder):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert role.returncode == 0 and ctl.returncode == 0
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 46
