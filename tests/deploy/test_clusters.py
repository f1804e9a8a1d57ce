"""Cluster specs: each mistake is named before any process starts; groups go to the cluster
that names them (the SLURM job script itself: ``tests/deploy/launchers/test_slurm.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.placement import GroupSpec, RoleSpec
from deploy.clusters import ClusterSpec, assign, check_spec, load_spec
from deploy.experiment import Experiment, ExperimentError, load
from deploy.launchers.base import role_argv
from tests.deploy.test_multicluster import WITH_ROLLOUT

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]


def experiment(*extra: str) -> Experiment:
    return load(EXAMPLES / "quickstart.yaml", [*WITH_ROLLOUT, *extra], quick=True)


def spec(**fields: Any) -> ClusterSpec:
    raw: dict[str, Any] = {
        "controller": {"bind": "tcp://127.0.0.1:0"},
        "clusters": {"home": {"kind": "local"}, "farm": {"kind": "slurm", "tasks_per_node": 4}},
        "groups": {"actor": "home", "rollout": "farm"},
    }
    raw.update(fields)
    return ClusterSpec.model_validate(raw)


def test_groups_are_named_by_group_or_by_role() -> None:
    exp = experiment()
    assert assign(spec(), exp) == {"main": "home", "gen": "farm"}
    assert assign(spec(groups={"main": "home", "gen": "home"}), exp) == {
        "main": "home",
        "gen": "home",
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"groups": {"actor": "home", "critic": "farm"}}, "no group or role 'critic'"),
        ({"groups": {"actor": "home", "rollout": "moon"}}, "no cluster 'moon' (clusters: home"),
        ({"groups": {"actor": "home"}}, "groups ['gen'] run on no cluster"),
        (
            {"groups": {"actor": "home", "reward": "farm", "rollout": "farm"}},
            "group 'main' is already placed on 'home'",
        ),
        ({"controller": {"bind": "tcp://127.0.0.1"}}, "tcp://HOST:PORT"),
        ({"controller": {"bind": "tcp://0.0.0.0:5555"}}, "set controller.connect"),
        ({"controller": {"bind": "tcp://10.1.2.3:5555"}}, "hybridflow keys DIR --clients main,gen"),
        (
            {"clusters": {"home": {"kind": "local", "slots": 2}, "farm": {"kind": "manual"}}},
            "groups ['main'] need 3 ranks but it has slots: 2",
        ),
        (
            {
                "clusters": {
                    "home": {"kind": "ray", "address": "auto"},
                    "farm": {"kind": "ray", "address": "10.0.0.9:6379"},
                }
            },
            "clusters.farm is a second kind: ray cluster (clusters.home is one)",
        ),
        (
            {
                "clusters": {
                    "home": {"kind": "local"},
                    "farm": {"kind": "slurm", "gpus_per_node": 1},
                }
            },
            None,
        ),
    ],
)
def test_a_bad_spec_names_what_to_fix(fields: dict[str, Any], message: str | None) -> None:
    exp = experiment("placement.main.nproc=3") if "slots" in str(fields) else experiment()
    if message is None:  # the control case: this one is fine
        check_spec(spec(**fields), exp, probe=False)
        return
    with pytest.raises(ExperimentError, match=re.escape(message)):
        check_spec(spec(**fields), exp, probe=False)


def test_more_ranks_than_a_slurm_node_holds() -> None:
    exp = experiment("placement.gen.nproc=5")
    with pytest.raises(ExperimentError, match=r"node 0 of the job would run 5 tasks .* holds 4"):
        check_spec(spec(), exp, probe=False)
    two_nodes = spec(clusters={"home": {"kind": "local"}, "farm": {"kind": "slurm", "nodes": 2}})
    check_spec(two_nodes, experiment(), probe=False)  # unknown size without a probe: allowed


def test_missing_key_files_are_listed(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    bad = spec(controller={"bind": "tcp://10.1.2.3:5555"}, keys=str(keys))
    with pytest.raises(ExperimentError, match=r"gen\.key_secret.*--clients main,gen"):
        check_spec(bad, experiment(), probe=False)
    subprocess.run([*CLI, "keys", str(keys), "--clients", "gen"], check=True, capture_output=True)
    check_spec(bad, experiment(), probe=False)


def test_spec_files_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"controller": {"bind": "tcp://127.0.0.1:0"}, "clusters": {}}))
    with pytest.raises(ExperimentError, match=r"clusters: .*at least 1"):
        load_spec(path)
    path.write_text("controller: {bind: x}\nclusters: {a: {kind: cloud}}\ngroups: {main: a}\n")
    with pytest.raises(ExperimentError, match=r"clusters\.a"):
        load_spec(path)
    path.write_text(
        "controller: {bind: 'tcp://127.0.0.1:0'}\nkeys: k\n"
        "clusters: {a: {kind: local}}\ngroups: {main: a}\n"
    )
    assert load_spec(path).keys == tmp_path / "k"  # relative to the spec file


def test_no_slurm_commands_is_a_clear_error(tmp_path: Path) -> None:
    exp = experiment()
    path = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path)  # nothing there
    try:
        with pytest.raises(
            ExperimentError, match=r"cluster 'farm': SLURM's commands .* not on PATH"
        ):
            check_spec(spec(), exp, probe=True)
    finally:
        os.environ["PATH"] = path


def test_the_role_command_for_a_group() -> None:
    group = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")}, nproc=2, tp=2)
    argv = role_argv(group, "tcp://h:1", None, "/k")
    assert argv[:2] == ["role", "rollout"]
    assert argv[argv.index("--nproc") + 1] == "2" and argv[argv.index("--tp") + 1] == "2"
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[-4:] == ["--keys", "/k", "--client", "gen"]
    on_gpus = role_argv(group.model_copy(update={"device": "cuda"}), "tcp://h:1", None, None)
    assert on_gpus[on_gpus.index("--device") + 1] == "cuda"


@pytest.mark.parametrize("name", ["here_and_slurm.yaml", "two_sites.yaml"])
def test_the_example_specs_place_every_group(name: str) -> None:
    found = load_spec(EXAMPLES / "clusters" / name)
    assert set(assign(found, experiment()).values()) <= set(found.clusters)


def ray_spec(address: str, **pool: Any) -> ClusterSpec:
    return spec(
        clusters={"home": {"kind": "local"}, "pool": {"kind": "ray", "address": address, **pool}},
        groups={"actor": "home", "rollout": "pool"},
    )


def test_a_ray_cluster_that_does_not_answer_is_named_within_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ray.init`` waits minutes for a GCS that is not there: the address is probed first."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(
        ExperimentError,
        match=rf"cluster 'pool': no Ray cluster answers at address '127.0.0.1:{port}' \(.*refused",
    ):
        check_spec(ray_spec(f"127.0.0.1:{port}"), experiment(), probe=True)
    assert time.monotonic() - start < 10
    with pytest.raises(ExperimentError, match=r"not auto, HOST:PORT or ray://HOST:PORT"):
        check_spec(ray_spec("head-without-port"), experiment(), probe=True)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ExperimentError, match=r"needs the ray package .*hybridflow\[ray\]"):
        check_spec(ray_spec(f"127.0.0.1:{port}"), experiment(), probe=True)


def test_a_group_over_ray_nodes_needs_keys_and_other_kinds_refuse_it() -> None:
    exp = experiment("placement.gen={roles: [rollout], nproc: 2, nodes: 2}")
    with pytest.raises(ExperimentError, match=r"group 'gen' spans nodes, so links .* need CURVE"):
        check_spec(ray_spec("auto"), exp, probe=False)
    local = spec(clusters={"home": {"kind": "local"}, "farm": {"kind": "remote", "via": ["sh"]}})
    with pytest.raises(ExperimentError, match=r"which only a slurm or ray cluster or a remote"):
        check_spec(local, exp, probe=False)
    with pytest.raises(ExperimentError, match=r"clusters\.pool\.ray\.gpus: unknown field"):
        load_spec_text("clusters: {pool: {kind: ray, gpus: 1}}\ngroups: {main: pool}\n")


def test_a_remote_cluster_of_several_hosts_holds_a_group_over_them(tmp_path: Path) -> None:
    """``hosts`` instead of ``via``: a group may span as many hosts as there are, no more, each
    host within ``slots``; one of via and hosts, and each host its address."""
    keys = tmp_path / "keys"
    argv = [*CLI, "keys", str(keys), "--clients", "main,gen"]
    subprocess.run(argv, check=True, capture_output=True)
    host = lambda address: {"via": ["ssh", address], "address": address}  # noqa: E731
    pair: dict[str, Any] = {"kind": "remote", "hosts": [host("10.0.0.7"), host("10.0.0.8")]}
    two = spec(clusters={"home": {"kind": "local"}, "pair": pair}, keys=str(keys))
    two.groups.update({"rollout": "pair"})
    check_spec(two, experiment("placement.gen={roles: [rollout], nproc: 4, nodes: 2}"))
    with pytest.raises(ExperimentError, match=r"group 'gen' spans 3 nodes but the cluster has 2 "):
        check_spec(two, experiment("placement.gen={roles: [rollout], nproc: 3, nodes: 3}"))
    pair["slots"] = 1  # each host holds 1 rank: 2 a host is too many
    tight = spec(clusters={"home": {"kind": "local"}, "pair": pair}, keys=str(keys))
    tight.groups.update({"rollout": "pair"})
    with pytest.raises(ExperimentError, match=r"node 0 .* 2 tasks .*clusters\.pair\.slots"):
        check_spec(tight, experiment("placement.gen={roles: [rollout], nproc: 4, nodes: 2}"))
    with pytest.raises(ExperimentError, match=r"clusters\.far\.remote: set via .* or hosts"):
        load_spec_text("clusters: {far: {kind: remote}}\ngroups: {main: far}\n")
    both = "{kind: remote, via: [ssh, a], hosts: [{via: [ssh, b], address: b}]}"
    with pytest.raises(ExperimentError, match=r"not both"):
        load_spec_text(f"clusters: {{far: {both}}}\ngroups: {{main: far}}\n")
    with pytest.raises(ExperimentError, match=r"hosts\.0\.address: Field required"):
        load_spec_text("clusters: {far: {kind: remote, hosts: [{via: [ssh, a]}]}}\ngroups: {}\n")


def load_spec_text(text: str) -> ClusterSpec:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text("controller: {bind: 'tcp://127.0.0.1:0'}\n" + text)
        return load_spec(path)
