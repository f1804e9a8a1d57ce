"""``hybridflow controller EXP --bind tcp://...``: the controller alone, its group started by hand
with the command it prints, a whole (quick) run over TCP; and a group that never comes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]


def wait_for(path: Path, pattern: str, proc: subprocess.Popen[str], limit: float) -> re.Match[str]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text()) if path.exists() else None
        if found:
            return found
        assert proc.poll() is None, path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} never appeared in {path}")


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
        line = wait_for(err, r"HYBRIDFLOW_TOKEN=(\w+) hybridflow role (.+)\n", ctl, 60)
        env = {**os.environ, "HYBRIDFLOW_TOKEN": line.group(1)}
        role_args = [*line.group(2).split(), "--run-dir", str(tmp_path / "role")]
        assert role_args[:2] == ["actor,reward", "--connect"]
        assert role_args[2].startswith("tcp://127.0.0.1:")
        command = [*CLI, "role", *role_args]
        if launcher == "torchrun":
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            command = [*torchrun, "--master-port", str(free_port()), "-m", "deploy.cli", "role"]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_group_that_never_joins_is_named(tmp_path: Path) -> None:
    argv = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", "--wait", "2"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "groups ['main'] did not join tcp://127.0.0.1:" in done.stderr
    assert "within 2 s" in done.stderr and "--wait" in done.stderr
    assert "--resume" not in done.stderr  # nothing to resume from
