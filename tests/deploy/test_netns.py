"""Two "hosts" as network namespaces joined by a veth pair: the controller in one, a process
group in the other, each with its own host id, over CURVE. A quick GRPO run completes, and the
veth's byte counters show that the batches crossed TCP (no same-host shared-memory shortcut)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_system
from tests.deploy.test_controller_cli import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]
A, B = "10.231.7.1", "10.231.7.2"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"hfprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made.returncode == 0


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    require_system("network namespaces", netns_available(), "run the tests as root with iproute2")
    a, b = f"hfa{os.getpid()}", f"hfb{os.getpid()}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"v{a}", "netns", a, "type", "veth", "peer", f"v{b}", "netns", b)
        for ns, dev, addr in ((a, f"v{a}", A), (b, f"v{b}", B)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def veth_bytes(ns: str) -> int:
    out = subprocess.run(
        ["ip", "-n", ns, "-s", "-j", "link", "show", f"v{ns}"], capture_output=True, text=True
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_across_two_hosts_goes_over_tcp(hosts: tuple[str, str], tmp_path: Path) -> None:
    a, b = hosts
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    err = tmp_path / "controller.err"
    argv = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json", "--wait", "90"]
    argv += ["--bind", f"tcp://{A}:0", "--keys", str(keys), "--run-dir", str(tmp_path / "run")]
    env_a = {**os.environ, "HYBRIDFLOW_HOST_ID": "host-a"}
    env_b = {**os.environ, "HYBRIDFLOW_HOST_ID": "host-b"}
    before = veth_bytes(a)
    with err.open("w") as stderr:
        ctl = subprocess.Popen(
            ["ip", "netns", "exec", a, *CLI, *argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env_a,
        )
    try:
        found = wait_for(err, r"HYBRIDFLOW_TOKEN=(\w+) hybridflow role (.+)\n", ctl, 60)
        args = [*found.group(2).split(), "--run-dir", str(tmp_path / "role")]
        assert args[2].startswith(f"tcp://{A}:")
        role = subprocess.run(
            ["ip", "netns", "exec", b, *CLI, "role", *args],
            env={**env_b, "HYBRIDFLOW_TOKEN": found.group(1)},
            timeout=240,
        )
        out, _ = ctl.communicate(timeout=60)
    finally:
        if ctl.poll() is None:
            ctl.kill()
    assert role.returncode == 0 and ctl.returncode == 0, err.read_text()[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 46
    crossed = veth_bytes(a) - before
    # 46 steps of batches, validations and weights' worth of replies: far more than handshakes
    print(f"bytes over the veth: {crossed}")
    assert crossed > 1_000_000, crossed
