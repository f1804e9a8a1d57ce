"""Hosts as network namespaces joined by veth pairs, each with its own host id, all links CURVE.

- Two hosts: the controller in one, a process group started by hand in the other. A quick GRPO
  run completes, and the veth's byte counters show that the batches crossed TCP (no same-host
  shared-memory shortcut).
- Three hosts and a cluster spec: the controller and the actor on host A (a local cluster), the
  reward on host B (a remote cluster reached by ``ip netns exec``) and the rollout group on host
  C (a remote cluster reached by ssh: a real sshd runs there).
  C's group takes the actor's weights over its CURVE link every step and generates every batch;
  meanwhile two strangers on B (no key, a wrong key) are refused and the run carries on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import yaml

from tests.conftest import require_system
from tests.deploy.sshd import sshd
from tests.deploy.test_controller_cli import ANNOUNCED, wait_for_line
from tests.deploy.test_multicluster import assert_fresh_weights

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


HUB = "10.231.9.1"  # host A's own address; B and C route to it over their links


@pytest.fixture
def three_hosts() -> Iterator[tuple[str, str, str]]:
    """A in the middle: A-B on 10.231.7.0/24, A-C on 10.231.8.0/24, and HUB on A's loopback,
    which both B and C reach through their link."""
    require_system("network namespaces", netns_available(), "run the tests as root with iproute2")
    names = tuple(f"hf{x}{os.getpid()}" for x in "abc")
    a, b, c = names
    try:
        for ns in names:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", a, "addr", "add", f"{HUB}/32", "dev", "lo")
        for peer, net in ((b, "10.231.7"), (c, "10.231.8")):
            sh("ip", "link", "add", f"v{peer}", "netns", peer, "type", "veth", "peer", f"w{peer}")
            sh("ip", "link", "set", f"w{peer}", "netns", a)
            for ns, dev, addr in ((a, f"w{peer}", f"{net}.1"), (peer, f"v{peer}", f"{net}.2")):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", peer, "route", "add", HUB, "via", f"{net}.1")
        yield a, b, c
    finally:
        for ns in names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_processes(ns: str, run_dir: Path) -> list[int]:
    """The processes in network namespace ``ns`` whose command line names ``run_dir``."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, pids.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if str(run_dir).encode() in argv:
            found.append(pid)
    return found


def nothing_left(ns: str, run_dir: Path) -> bool:
    return not run_processes(ns, run_dir)


def veth_bytes(ns: str) -> int:
    return veth_bytes_of(ns, f"v{ns}")


def veth_bytes_of(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "-n", ns, "-s", "-j", "link", "show", dev], capture_output=True, text=True
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


#: the group's store port (torchrun's static rendezvous, on host B: nothing else listens there)
STORE_PORT = 29411


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_across_two_hosts_goes_over_tcp(hosts: tuple[str, str], tmp_path: Path) -> None:
    """The controller on host A; the group started by hand with ``torchrun --nnodes 2``, one rank
    on each host (rank 0, its coordinator, on B): the printed role command runs under torchrun
    (less its --nproc), the ranks meet at B's store, their links and the controller's are CURVE
    over TCP, and the gradients' all-reduce crosses between the hosts."""
    a, b = hosts
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    err = tmp_path / "controller.err"
    argv = ["controller", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json", "--wait", "90"]
    argv += ["--bind", f"tcp://{A}:0", "--keys", str(keys), "--run-dir", str(tmp_path / "run")]
    env_of = {ns: {**os.environ, "HYBRIDFLOW_HOST_ID": f"host-{ns[2]}"} for ns in (a, b)}
    before = veth_bytes(a)
    with err.open("w") as stderr:
        ctl = subprocess.Popen(
            ["ip", "netns", "exec", a, *CLI, *argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env_of[a],
        )
    nodes: list[subprocess.Popen[str]] = []
    try:
        found = wait_for_line(err, ANNOUNCED, ctl, 60, "the controller printing the role command")
        args = [*found.group(2).split(), "--run-dir", str(tmp_path / "role")]
        assert args[2].startswith(f"tcp://{A}:") and "--keys" in args
        # less its --nproc: torchrun sizes the group (and its own parser would take the option
        # for an abbreviation of --nproc-per-node)
        at = args.index("--nproc")
        args = args[:at] + args[at + 2 :]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        torchrun += ["--nproc-per-node", "1", "--master-addr", B, "--master-port", str(STORE_PORT)]
        for node_rank, ns in enumerate((b, a)):
            command = [*torchrun, "--node-rank", str(node_rank), "-m", "deploy.cli", "role", *args]
            with (tmp_path / f"node{node_rank}.out").open("w") as log:
                nodes.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *command],
                        env={**env_of[ns], "HYBRIDFLOW_TOKEN": found.group(1)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        codes = [node.wait(timeout=240) for node in nodes]
        out, _ = ctl.communicate(timeout=60)
    finally:
        for proc in (ctl, *nodes):
            if proc.poll() is None:
                proc.kill()
    said = [(tmp_path / f"node{i}.out").read_text() for i in (0, 1)]
    assert codes == [0, 0] and ctl.returncode == 0, err.read_text()[-2000:] + said[0][-2000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 46
    # rank 0 (on B) coordinates: it says the group of 2 ranks joined, and how it ended
    assert "group main joined the controller" in said[0] and "on 2 ranks" in said[0], said[0]
    crossed = veth_bytes(a) - before
    # 46 steps of batches, gradients, validations and weights' worth of replies
    print(f"bytes over the veth: {crossed}")
    assert crossed > 1_000_000, crossed


SSH_HOST = "10.231.8.2"  # host C's address on its link to A


@pytest.fixture
def ssh_to_c(three_hosts: tuple[str, str, str], tmp_path: Path) -> Iterator[list[str]]:
    """A real OpenSSH server on host C (its own hostname through a UTS namespace); yields the
    ssh command that logs in there."""
    prefix = ["ip", "netns", "exec", three_hosts[2], "unshare", "--uts"]
    with sshd(tmp_path / "ssh", SSH_HOST, prefix, "hfhostc") as login:
        yield login


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_hosts_from_a_cluster_spec_with_strangers_refused(
    three_hosts: tuple[str, str, str], ssh_to_c: list[str], tmp_path: Path
) -> None:
    """Host C is reached by ssh (a real sshd there, its own hostname, so its own host id), host
    B by ``ip netns exec``."""
    a, b, c = three_hosts
    keys, stranger_keys = tmp_path / "keys", tmp_path / "stranger"
    for folder, clients in ((keys, "main,scorer,gen"), (stranger_keys, "gen")):
        argv = [*CLI, "keys", str(folder), "--clients", clients]
        subprocess.run(argv, check=True, capture_output=True)
    # the stranger pins the right controller key, but its own key is not among the accepted
    shutil.copy(keys / "controller.key", stranger_keys / "controller.key")
    port = 47001  # a fresh namespace has no listener
    on = lambda ns, host: ["ip", "netns", "exec", ns, "env", f"HYBRIDFLOW_HOST_ID={host}"]  # noqa: E731
    spec = {
        "controller": {"bind": f"tcp://{HUB}:{port}", "wait": 90},
        "keys": str(keys),
        "clusters": {
            "home": {"kind": "local"},
            "lab": {"kind": "remote", "via": [*on(b, "host-b"), "sh", "-c"]},
            "far": {"kind": "remote", "via": ssh_to_c},
        },
        "groups": {"actor": "home", "reward": "lab", "rollout": "far"},
    }
    (tmp_path / "clusters.yaml").write_text(yaml.safe_dump(spec))
    # Two strangers on B dial the controller for the whole run: no key (the CURVE handshake
    # fails), and a key pair the controller does not list (its ZAP handler says no).
    role = [*CLI, "role", "rollout", "--group", "gen", "--connect", f"tcp://{HUB}:{port}"]
    role += ["--wait", "25"]
    strangers = [
        subprocess.Popen(
            [*on(b, "host-b"), *role, *extra, "--run-dir", str(tmp_path / f"s{i}")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, extra in enumerate(([], ["--keys", str(stranger_keys), "--client", "gen"]))
    ]
    sets = ["placement.main={roles: [actor], nproc: 2}"]
    sets += ["placement.scorer={roles: [reward], nproc: 1}"]
    sets += ["roles.rollout={model: base}", "placement.gen={roles: [rollout], nproc: 1}"]
    argv = ["run", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json"]
    argv += ["--clusters", str(tmp_path / "clusters.yaml"), "--run-dir", str(tmp_path / "run")]
    argv += [x for s in sets for x in ("--set", s)]
    before = veth_bytes_of(c, f"v{c}")
    done = subprocess.run(
        [*on(a, "host-a"), *CLI, *argv], capture_output=True, text=True, timeout=240
    )
    assert_fresh_weights(done, tmp_path / "run")  # C generated with each new version
    assert "Accepted publickey for root" in (tmp_path / "ssh" / "log").read_text()
    crossed = veth_bytes_of(c, f"v{c}") - before
    print(f"bytes over host C's link: {crossed}")
    assert crossed > 7 * 2_000_000, crossed  # 7 syncs of > 2 MB of weights, and the batches
    for stranger in strangers:
        _, err = stranger.communicate(timeout=60)
        assert stranger.returncode == 1
        assert "no answer from the controller" in " ".join(err.split()), err[-1500:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_over_two_ssh_hosts_loses_one_and_comes_back(
    hosts: tuple[str, str], tmp_path: Path
) -> None:
    """A ``remote`` cluster of two hosts, one reached by ``ip netns exec`` (A, where the
    controller runs too) and one by ssh (B: a real sshd, its own hostname): the quickstart's
    group of 2 ranks spans both, its ranks meeting at A. After step 3 the rank on B is killed:
    the run rolls back to its checkpoint, the rank comes back over a second ssh login, and the
    run completes, each step once, its gradients having crossed the link."""
    from tests.deploy.test_slurm_nodes import kill_node, steps_logged
    from tests.waiting import wait_for

    a, b = hosts
    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    at_a = ["ip", "netns", "exec", a, "env", "HYBRIDFLOW_HOST_ID=host-a"]
    prefix = ["ip", "netns", "exec", b, "unshare", "--uts"]
    with sshd(tmp_path / "ssh", B, prefix, "hfhostb") as login:
        spec = {
            "controller": {"bind": f"tcp://{A}:47011", "wait": 90},
            "keys": str(keys),
            "clusters": {
                "pair": {
                    "kind": "remote",
                    "hosts": [
                        {"via": [*at_a, "sh", "-c"], "address": A},
                        {"via": login, "address": B},
                    ],
                }
            },
            "groups": {"main": "pair"},
        }
        (tmp_path / "clusters.yaml").write_text(yaml.safe_dump(spec))
        sets = [
            "placement.main={roles: [actor, reward], nproc: 2, nodes: 2, "
            "restart: {max: 2, backoff_s: [0.0]}}",
            "stages.0.steps=6",
            "stages.1.steps=2",
            "trainer.val_every=100",
            "trainer.save_every=2",
        ]
        argv = ["run", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json"]
        argv += ["--clusters", str(tmp_path / "clusters.yaml"), "--run-dir", str(run_dir)]
        argv += [x for s in sets for x in ("--set", s)]
        before = veth_bytes(a)
        out = tmp_path / "run.out"
        with (
            out.open("w") as sink,
            subprocess.Popen([*at_a, *CLI, *argv], stdout=sink, stderr=subprocess.STDOUT) as run,
        ):
            try:
                wait_for(lambda: 3 in steps_logged(run_dir), 180, "step 3", proc=run)
                killed = kill_node(b, run_dir)
                run.wait(timeout=240)
            finally:
                run.kill()
        logins = (tmp_path / "ssh" / "log").read_text().count("Accepted publickey")
        # nothing of the run is left on either host (the ssh sessions ended with it)
        for ns in (a, b):
            wait_for(partial(nothing_left, ns, run_dir), 30, f"no process of the run in {ns}")
    said = out.read_text()
    assert run.returncode == 0, said[-5000:]
    assert len(killed) == 1, killed  # the group's rank on B
    assert steps_logged(run_dir) == list(range(1, 9))  # each step once
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["group"] for e in events if e.get("event") == "rollback"] == ["main"], said[-3000:]
    fault = next(e for e in events if e.get("event") == "fault")
    # rank 1, seen gone first by its coordinator (its link closed) or by the launcher (its ssh
    # session ended, the host named), whichever says so first
    assert (fault["group"], fault["rank"]) == ("main", 1), fault
    assert logins == 2  # rank 1 started over ssh, and again after the kill
    crossed = veth_bytes(a) - before
    print(f"bytes over the veth: {crossed}")
    assert crossed > 1_000_000, crossed  # 8 steps' all-reduces of the gradients, the batches


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dropped_ssh_session_ends_the_old_incarnation_on_its_host(
    hosts: tuple[str, str], tmp_path: Path
) -> None:
    """A group on host B over ssh (a ``remote`` cluster, one host), the controller on A. The
    ssh client on A dies (a dropped connection): its group is declared dead and restarted over a
    second login, and the old incarnation, still running on B and linked to the controller, is
    told to stop: its processes end on B while the new one trains."""
    from tests.deploy.test_slurm_nodes import steps_logged
    from tests.waiting import wait_for

    a, b = hosts
    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    at_a = ["ip", "netns", "exec", a, "env", "HYBRIDFLOW_HOST_ID=host-a"]
    prefix = ["ip", "netns", "exec", b, "unshare", "--uts"]
    with sshd(tmp_path / "ssh", B, prefix, "hfhostb") as login:
        spec = {
            "controller": {"bind": f"tcp://{A}:47013", "wait": 90},
            "keys": str(keys),
            "clusters": {"far": {"kind": "remote", "via": login}},
            "groups": {"main": "far"},
        }
        (tmp_path / "clusters.yaml").write_text(yaml.safe_dump(spec))
        sets = [
            "placement.main.restart={max: 2, backoff_s: [0.0]}",
            "stages.0.steps=6",
            "stages.1.steps=400",
            "trainer.val_every=1000",
            "trainer.save_every=2",
        ]
        argv = ["run", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json"]
        argv += ["--clusters", str(tmp_path / "clusters.yaml"), "--run-dir", str(run_dir)]
        argv += [x for s in sets for x in ("--set", s)]
        out = tmp_path / "run.out"
        with (
            out.open("w") as sink,
            subprocess.Popen([*at_a, *CLI, *argv], stdout=sink, stderr=subprocess.STDOUT) as run,
        ):
            try:
                wait_for(lambda: 3 in steps_logged(run_dir), 180, "step 3", proc=run)
                old = run_processes(b, run_dir)
                (client,) = [p for p in run_processes(a, run_dir) if is_ssh(p)]
                os.kill(client, 9)  # the connection drops; B's processes do not see it
                wait_for(
                    lambda: not any(alive(p) for p in old),
                    60,
                    "the old incarnation's processes on B gone",
                    proc=run,
                    detail=lambda: [p for p in old if alive(p)],
                )
                again = len(steps_logged(run_dir))
                wait_for(lambda: len(steps_logged(run_dir)) > again, 120, "a step after", proc=run)
                run.terminate()
                run.wait(timeout=120)
            finally:
                run.kill()
        logins = (tmp_path / "ssh" / "log").read_text().count("Accepted publickey")
        for ns in (a, b):
            wait_for(partial(nothing_left, ns, run_dir), 30, f"no process of the run in {ns}")
    assert old and logins == 2, (old, logins)
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["group"] for e in events if e.get("event") == "rollback"] == ["main"]


def is_ssh(pid: int) -> bool:
    try:
        return (
            Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name == "ssh"
        )
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
