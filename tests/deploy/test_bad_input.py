"""Bad input at the deployment edges: each is a clear error that says what to fix, found before
anything starts (or, for a controller that never answers, within the wait the user chose), and
leaves no process and no half-written run directory behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.test_multicluster import rank_processes, settle

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]


def hybridflow(*argv: str, limit: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=limit)


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.timeout(60)
def test_controller_port_in_use_or_address_not_here(tmp_path: Path) -> None:
    quick = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = hybridflow(
            *quick, "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "r")
        )
    assert done.returncode == 2
    assert f"port {port} is in use" in one_line(done.stderr)
    assert not (tmp_path / "r").exists()
    done = hybridflow(*quick, "--bind", "tcp://127.0.0.1", "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2 and "tcp://HOST:PORT" in done.stderr
    keys = tmp_path / "keys"
    hybridflow("keys", str(keys), "--clients", "main")
    done = hybridflow(
        *quick,
        "--bind",
        "tcp://192.0.2.250:5555",
        "--keys",
        str(keys),
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert done.returncode == 2 and "192.0.2.250 is not an address of this host" in done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("tcp://no-such-host.invalid:5555", "cannot resolve 'no-such-host.invalid'"),
        ("tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("http://127.0.0.1:5555", "tcp://HOST:PORT"),
        ("tcp://127.0.0.1:70000", "above 65535"),
    ],
)
def test_role_with_a_wrong_address_fails_at_once(
    address: str, message: str, tmp_path: Path
) -> None:
    start = time.monotonic()
    done = hybridflow("role", "actor", "--connect", address, "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert message in one_line(done.stderr)
    assert time.monotonic() - start < 20  # not the 120 s connect wait
    assert not (tmp_path / "logs").exists()  # no rank was started


@pytest.mark.timeout(90)
def test_role_facing_an_unreachable_controller_gives_up_after_wait(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    done = hybridflow(
        "role",
        "actor",
        "--connect",
        f"tcp://127.0.0.1:{port}",
        "--nproc",
        "2",
        "--wait",
        "3",
        "--run-dir",
        str(tmp_path),
    )
    took = time.monotonic() - start
    assert done.returncode == 1
    text = one_line(done.stderr)
    assert f"no answer from the controller at tcp://127.0.0.1:{port} within 3 s" in text
    assert "hybridflow role --wait" in text
    assert took < 40, took
    assert settle(lambda: rank_processes(f"127.0.0.1:{port}")) == []


@pytest.mark.timeout(60)
def test_a_bad_cluster_spec_exits_2_with_nothing_written(tmp_path: Path) -> None:
    spec = tmp_path / "clusters.yaml"
    spec.write_text(
        "controller: {bind: 'tcp://127.0.0.1:0'}\n"
        "clusters: {home: {kind: local}}\n"
        "groups: {actor: home, critic: home}\n"
    )
    run = ["run", str(EXAMPLES / "quickstart.yaml"), "--quick", "--clusters", str(spec)]
    done = hybridflow(*run, "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2
    assert "groups.critic: the experiment has no group or role 'critic'" in one_line(done.stderr)
    spec.write_text(
        "controller: {bind: 'tcp://127.0.0.1:0'}\n"
        "clusters: {home: {kind: local}}\n"
        "groups: {actor: away}\n"
    )
    done = hybridflow(*run, "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2
    assert "groups.actor: no cluster 'away' (clusters: home)" in one_line(done.stderr)
    assert not (tmp_path / "r").exists()
