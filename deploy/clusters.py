"""Cluster specs: the clusters a run uses and which process groups run on each.

``hybridflow run EXPERIMENT.yaml --clusters CLUSTERS.yaml`` runs the experiment unchanged, with one
controller (this process) and each placed group started on the cluster the spec names::

    controller:
      bind: tcp://10.0.0.1:5555      # an address every cluster can reach (":0": any free port)
      # connect: tcp://head:5555     # what groups dial, when not bind's (bind on 0.0.0.0, NAT)
      wait: 600                      # seconds for every group to join (a SLURM queue can be slow)
    keys: keys                       # `hybridflow keys keys --clients main,gen` (relative to here)
    clusters:
      home: {kind: local}                                  # child processes of the controller
      lab:  {kind: remote, via: [ssh, gpu7]}               # a command line run through `via`
      farm: {kind: slurm, nodes: 2, gpus_per_node: 8, partition: gpu, via: [ssh, login.farm]}
      pool: {kind: ray, address: auto, gpus_per_rank: 1}   # a placement group per group on Ray
      desk: {kind: manual}                                 # the command is printed; start it by hand
    groups:                          # a placement group, or a role (the group that hosts it)
      main: home
      rollout: farm

``via`` is a command that runs one shell command line on the cluster's host (``[ssh, HOST]``;
``[ip, netns, exec, NS, sh, -c]`` in the tests); empty means this host. Everything here is checked
before any process starts or any file is written: unknown groups, roles and clusters, unplaced
groups, missing key files, an address off this host without keys, and more ranks than a cluster's
allocation holds (asked of ``sinfo`` when the spec does not say); SLURM's client commands and
munge are probed on each SLURM cluster at the same time.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deploy.commands.keys import client_files, server_files
from deploy.experiment import (
    Experiment,
    ExperimentError,
    GroupConfig,
    explain,
    placement,
    read_yaml,
)
from deploy.launchers.sbatch import overfull, slurm_cpus_per_node
from transport.channel import is_local_address, split_tcp


class LocalCluster(BaseModel):
    """This host: the groups are child processes of the controller."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["local"]
    slots: int | None = Field(None, ge=1, description="ranks this host may run (default: any)")


class RemoteHost(BaseModel):
    """One host of a ``remote`` cluster of several."""

    model_config = ConfigDict(extra="forbid")

    via: list[str] = Field(min_length=1, description="runs a shell command line on that host")
    address: str = Field(
        min_length=1,
        description="the name or IP the cluster's other hosts reach it by (a group whose rank 0 "
        "runs there meets its ranks there)",
    )


class RemoteCluster(BaseModel):
    """Other hosts reached by a command (ssh). One host (``via``): one ``hybridflow role`` per
    group there. Several (``hosts``): each group on the next of them in turn, a group with
    ``nodes: K`` over K of them, its ranks laid out host by host, one process each."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["remote"]
    via: list[str] = Field(
        default_factory=list, description="runs a shell command line on its one host"
    )
    hosts: list[RemoteHost] = Field(
        default_factory=list, description="its hosts, when it has several (instead of via)"
    )
    python: str | None = Field(None, description="python there (default: this one's path)")
    workdir: str | None = Field(None, description="checkout there (default: this one's path)")
    keys: str | None = Field(None, description="key directory there (default: this one's)")
    slots: int | None = Field(
        None, ge=1, description="ranks each of its hosts may run (default: any)"
    )

    @model_validator(mode="after")
    def _one_way_there(self) -> RemoteCluster:
        if bool(self.via) == bool(self.hosts):
            raise ValueError(
                "set via (the command that reaches its one host) or hosts (several, each "
                "with its via and address), not both"
                if self.via
                else "set via (the command that reaches its one host) or hosts (several)"
            )
        return self


class SlurmCluster(BaseModel):
    """A SLURM cluster: one batch job runs every group placed there, one srun step each."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["slurm"]
    via: list[str] = Field(
        default_factory=list, description="reaches its login node (default: sbatch here)"
    )
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    tasks_per_node: int | None = Field(
        None, ge=1, description="ranks one node holds (default: gpus_per_node, else its CPUs)"
    )
    partition: str | None = None
    time: str | None = Field(None, description="job time limit, e.g. 01:00:00")
    account: str | None = None
    python: str | None = None
    workdir: str | None = None
    keys: str | None = None


class RayCluster(BaseModel):
    """A Ray cluster: each group a placement group, each rank a Ray actor that runs it
    (``deploy/launchers/ray.py``); the mesh's links stay its own."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["ray"]
    address: str = Field(
        "auto", description="auto, HOST:PORT (the head's GCS) or ray://HOST:10001 (Ray Client)"
    )
    namespace: str | None = None
    runtime_env: dict[str, Any] | None = Field(None, description="Ray's runtime_env for the ranks")
    cpus_per_rank: float = Field(1.0, ge=0)
    gpus_per_rank: float | None = Field(
        None, ge=0, description="GPUs each rank reserves (default: 1 for a cuda group, else 0)"
    )
    resources_per_rank: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each rank reserves"
    )
    placement_timeout_s: float = Field(60.0, gt=0, description="seconds for Ray to place a group")
    python: str | None = Field(None, description="python on the nodes (default: the actor's)")
    workdir: str | None = Field(
        None, description="checkout on the nodes (default: this one's path)"
    )
    keys: str | None = Field(None, description="key directory on the nodes (default: this one's)")


class ManualCluster(BaseModel):
    """Groups started by hand with the command the controller prints."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["manual"]


AnyCluster = Annotated[
    LocalCluster | RemoteCluster | SlurmCluster | RayCluster | ManualCluster,
    Field(discriminator="kind"),
]


class ControllerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bind: str = Field(description="tcp://HOST:PORT to listen on (HOST 0.0.0.0: every interface)")
    connect: str | None = Field(
        None, description="the address groups dial, when not bind's (a name, a NAT's address)"
    )
    wait: float = Field(300.0, gt=0, description="seconds for every group to join")


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    controller: ControllerSpec
    keys: Path | None = Field(None, description="CURVE keys (hybridflow keys), relative to here")
    clusters: dict[str, AnyCluster] = Field(min_length=1)
    groups: dict[str, str] = Field(min_length=1, description="group or role -> cluster")


def load_spec(path: Path) -> ClusterSpec:
    try:
        spec = ClusterSpec.model_validate(read_yaml(path, "cluster spec"))
    except ValidationError as exc:
        raise ExperimentError(f"{path}: {explain(exc)}") from None
    if spec.keys is not None and not spec.keys.is_absolute():
        spec.keys = (path.parent / spec.keys).resolve()
    return spec


def assign(spec: ClusterSpec, exp: Experiment) -> dict[str, str]:
    """group -> cluster for every placed group; names the entry that is wrong."""
    groups = placement(exp)
    host_of = {role: g for g, cfg in groups.items() for role in cfg.roles}
    where: dict[str, str] = {}
    for key, cluster in spec.groups.items():
        group = key if key in groups else host_of.get(key)
        if group is None:
            raise ExperimentError(
                f"cluster spec groups.{key}: the experiment has no group or role {key!r} "
                f"(groups: {', '.join(groups)}; roles: {', '.join(host_of)})"
            )
        if cluster not in spec.clusters:
            raise ExperimentError(
                f"cluster spec groups.{key}: no cluster {cluster!r} "
                f"(clusters: {', '.join(spec.clusters)})"
            )
        if where.get(group, cluster) != cluster:
            raise ExperimentError(
                f"cluster spec groups.{key}: group {group!r} is already placed on "
                f"{where[group]!r} (roles of one group run on one cluster)"
            )
        where[group] = cluster
    unplaced = [g for g in groups if g not in where]
    if unplaced:
        raise ExperimentError(
            f"cluster spec: groups {unplaced} run on no cluster; name each under groups:"
        )
    return where


def check_spec(spec: ClusterSpec, exp: Experiment, probe: bool = True) -> dict[str, str]:
    """Everything that can be known before a process starts; returns group -> cluster.
    ``probe`` asks each SLURM cluster (sinfo) whether it answers and how many CPUs a node has."""
    where = assign(spec, exp)
    _check_addresses(spec.controller)
    if not is_local_address(spec.controller.bind) and spec.keys is None:
        raise ExperimentError(
            f"cluster spec: controller.bind {spec.controller.bind} leaves this host, so links "
            f"need CURVE keys; make them with `hybridflow keys DIR --clients {','.join(where)}` "
            "and set keys: DIR"
        )
    if spec.keys is not None:
        _check_keys(spec.keys, list(where))
    groups = placement(exp)
    rays = [
        n for n, c in spec.clusters.items() if isinstance(c, RayCluster) and n in where.values()
    ]
    if len(rays) > 1:  # a process is the driver of one Ray cluster: the second would be the first
        raise ExperimentError(
            f"cluster spec: clusters.{rays[1]} is a second kind: ray cluster (clusters.{rays[0]} "
            "is one); a run drives one Ray cluster: put the groups of both on one of them "
            "(groups:) or the other on a slurm, remote or local cluster"
        )
    for name, cluster in spec.clusters.items():
        mine = {g: groups[g] for g, c in where.items() if c == name}
        spread = [g for g, config in mine.items() if config.nodes > 1]
        several = isinstance(cluster, RemoteCluster) and cluster.hosts
        if spread and not (several or isinstance(cluster, SlurmCluster | RayCluster)):
            raise ExperimentError(
                f"cluster {name!r} ({cluster.kind}): group {spread[0]!r} spans "
                f"{mine[spread[0]].nodes} nodes, which only a slurm or ray cluster or a remote "
                f"one with hosts lays out; put it on one (groups.{spread[0]}) or set "
                f"placement.{spread[0]}.nodes: 1"
            )
        if spread and spec.keys is None:
            raise ExperimentError(
                f"cluster spec: group {spread[0]!r} spans nodes, so links between its ranks "
                "need CURVE keys; make them with `hybridflow keys DIR --clients "
                f"{','.join(where)}` and set keys: DIR"
            )
        if isinstance(cluster, SlurmCluster) and mine:
            _check_job_fits(name, cluster, mine, probe)
        elif isinstance(cluster, RayCluster) and mine and probe:
            _check_ray_fits(name, cluster, mine)
        elif isinstance(cluster, RemoteCluster) and cluster.hosts and mine:
            _check_hosts(name, cluster, mine)
        elif isinstance(cluster, LocalCluster | RemoteCluster) and cluster.slots:
            _check_slots(name, cluster.slots, mine)
    return where


def _check_addresses(controller: ControllerSpec) -> None:
    """``bind`` and ``connect`` are ``tcp://HOST:PORT``, and groups can dial one of them."""
    for field in ("bind", "connect"):
        try:
            address = getattr(controller, field)
            host, _ = split_tcp(address) if address is not None else ("-", 0)
        except ValueError as exc:
            raise ExperimentError(f"cluster spec controller.{field}: {exc}") from None
        if host in ("0.0.0.0", "::") and field == "bind" and controller.connect is None:
            raise ExperimentError(
                f"cluster spec controller.bind={controller.bind}: groups cannot dial {host}; set "
                "controller.connect to the address they reach this host by"
            )


def _check_keys(keys: Path, groups: list[str]) -> None:
    """The controller's key pair, and each group's pair and accepted public key."""
    needed = [*server_files(keys)]
    for group in groups:
        needed += [*client_files(keys, group), keys / "allowed" / f"{group}.key"]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise ExperimentError(
            f"cluster spec: key files missing: {', '.join(missing[:3])}; make them with "
            f"`hybridflow keys {keys} --clients {','.join(groups)}`"
        )


def _check_job_fits(
    name: str, cluster: SlurmCluster, mine: dict[str, GroupConfig], probe: bool
) -> None:
    """The SLURM cluster's groups fit its ``nodes`` (a node's size asked of sinfo if unknown)."""
    per_node = cluster.tasks_per_node or cluster.gpus_per_node or None
    if probe:
        cpus = slurm_cpus_per_node(f"cluster {name!r}", cluster.via, cluster.partition)
        per_node = per_node or cpus
    if per_node and (why := overfull(mine, cluster.nodes, per_node, controller=False)):
        raise ExperimentError(f"cluster {name!r}: {why} (clusters.{name}.nodes)")


def _check_ray_fits(name: str, cluster: RayCluster, mine: dict[str, GroupConfig]) -> None:
    """The Ray cluster answers, and some of its nodes can hold each group placed there."""
    from deploy.launchers.rayplace import check_groups  # ray is an extra: imported when used

    try:
        check_groups(name, cluster, dict(mine))
    except RuntimeError as exc:  # not installed, not answering, too small
        raise ExperimentError(str(exc)) from None


def _check_hosts(name: str, cluster: RemoteCluster, mine: dict[str, GroupConfig]) -> None:
    """A remote cluster of several hosts holds its groups: none spans more hosts than it has,
    and no host runs more than ``slots`` ranks."""
    hosts = len(cluster.hosts)
    for group, config in mine.items():
        if config.nodes > hosts:
            raise ExperimentError(
                f"cluster {name!r}: group {group!r} spans {config.nodes} nodes but the cluster "
                f"has {hosts} host(s); add hosts (clusters.{name}.hosts) or lower "
                f"placement.{group}.nodes"
            )
    if cluster.slots and (why := overfull(mine, hosts, cluster.slots, controller=False)):
        raise ExperimentError(f"cluster {name!r}: {why} (clusters.{name}.slots, a host's)")


def _check_slots(name: str, slots: int, mine: dict[str, GroupConfig]) -> None:
    ranks = sum(g.nproc for g in mine.values())
    if ranks > slots:
        raise ExperimentError(
            f"cluster {name!r}: groups {list(mine)} need {ranks} ranks but it has "
            f"slots: {slots}; raise clusters.{name}.slots or lower their nproc"
        )


@dataclass(frozen=True)
class ClusterPlan:
    """A checked cluster spec and the cluster each group runs on."""

    spec: ClusterSpec
    where: dict[str, str]


def cluster_plan(path: Path, exp: Experiment) -> ClusterPlan:
    """The cluster spec at ``path``, checked against ``exp`` (before anything starts)."""
    spec = load_spec(path)
    check_bind(spec.controller.bind, "cluster spec controller.bind")
    return ClusterPlan(spec, check_spec(spec, exp))


def check_bind(address: str, setting: str) -> None:
    """Fail before anything starts when ``tcp://HOST:PORT`` cannot be bound here: a port in
    use, a host that is not this machine's, a name that does not resolve."""
    try:
        host, port = split_tcp(address)
        family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except ValueError as exc:
        raise ExperimentError(f"{setting}: {exc}") from None
    except socket.gaierror as exc:
        raise ExperimentError(f"{setting} {address}: cannot resolve {host!r} ({exc})") from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(where)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = f"port {port} is in use (another controller?); pick another, or :0 for any"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = f"{host} is not an address of this host"
            else:
                why = str(exc)
            raise ExperimentError(f"{setting} {address}: {why}") from None
