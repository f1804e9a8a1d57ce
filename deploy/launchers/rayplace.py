"""Placing groups on a Ray cluster: joining it as a driver, what a group reserves, and whether
its nodes can hold it. Apart from the launcher (``ray.py``) so a cluster spec is checked before
anything starts (``deploy/clusters.py``) without the launchers' imports."""

from __future__ import annotations

import logging
import socket
from typing import Any, Protocol

from transport.device import DeviceKind

log = logging.getLogger("hybridflow.launcher")
INSTALL_HINT = "pip install 'hybridflow[ray]' (or pip install ray) on this machine and the cluster"


def import_ray() -> Any:
    """The ``ray`` module, or an error that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(f"a ray cluster needs the ray package ({exc}): {INSTALL_HINT}") from None
    return ray


class PlacementError(RuntimeError):
    """A group the Ray cluster cannot hold, or did not place in time."""


def _shown(resource: str) -> bool:
    """A resource a group can ask for (CPU, GPU, custom), not Ray's bookkeeping."""
    return resource not in ("memory", "object_store_memory") and ":" not in resource


class Sized(Protocol):
    """What placing a group needs of it (a ``GroupSpec`` or an experiment's ``GroupConfig``)."""

    @property
    def nproc(self) -> int: ...
    @property
    def nodes(self) -> int: ...
    @property
    def device(self) -> DeviceKind: ...


class RaySettings(Protocol):
    """What joining and placing need of a ``kind: ray`` cluster (``deploy.clusters.RayCluster``)."""

    @property
    def address(self) -> str: ...
    @property
    def namespace(self) -> str | None: ...
    @property
    def runtime_env(self) -> dict[str, Any] | None: ...
    @property
    def cpus_per_rank(self) -> float: ...
    @property
    def gpus_per_rank(self) -> float | None: ...
    @property
    def resources_per_rank(self) -> dict[str, float]: ...


joined: list[str] = []  # the clusters this process joined as a driver (``connect``)


def connect(ray: Any, name: str, cluster: RaySettings) -> None:
    """Join the cluster as this process's driver, unless it is one already (its own program's
    ``ray.init``, or an earlier check); an error names the address when nothing answers."""
    if ray.is_initialized():
        return
    problem = unreachable(cluster.address)
    if problem:  # ray.init would wait minutes for a GCS that is not there
        raise RuntimeError(
            f"cluster {name!r}: no Ray cluster answers at address {cluster.address!r} "
            f"({problem}); start one with `ray start --head`, or set clusters.{name}.address"
        )
    try:
        ray.init(
            address=cluster.address,
            namespace=cluster.namespace,
            runtime_env=cluster.runtime_env,
            log_to_driver=False,  # the ranks' output goes to the run's logs
            logging_level=logging.WARNING,
            configure_logging=False,
        )
    except Exception as exc:  # ConnectionError, a timeout, a version mismatch: say which
        raise RuntimeError(
            f"cluster {name!r}: no Ray cluster answered at address {cluster.address!r} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); start one "
            f"with `ray start --head`, or set clusters.{name}.address"
        ) from None
    joined.append(name)
    say_joined(ray, name, cluster.address)


def say_joined(ray: Any, name: str, address: str) -> None:
    """Name the cluster joined in the run's first lines: its GCS address and live nodes; with
    ``address: auto`` on a host that runs several Ray clusters, say that the newest was taken."""
    gcs = ray.get_runtime_context().gcs_address
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    log.warning("cluster %r: joined the Ray cluster at %s (%d live node(s))", name, gcs, alive)
    if address != "auto":
        return
    try:
        from ray._private.services import find_gcs_addresses  # Ray's own lookup for "auto"

        running = sorted(find_gcs_addresses())
    except Exception:  # a private helper: gone in another Ray, the warning is lost, not the run
        return
    if len(running) > 1:
        log.warning(
            "cluster %r: address: auto, and %d Ray clusters run on this host (%s): it joined "
            "%s, the newest; set clusters.%s.address to choose",
            name,
            len(running),
            ", ".join(running),
            gcs,
            name,
        )


PROBE_S = 5.0  # how long a cluster's address may take to accept a connection


def unreachable(address: str) -> str:
    """Why nothing listens at a Ray ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``); empty
    when something does, or for ``auto`` (Ray finds this machine's cluster itself)."""
    if address == "auto":
        return ""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return "not auto, HOST:PORT or ray://HOST:PORT"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S):
            return ""
    except OSError as exc:
        return f"{exc.strerror or exc} within {PROBE_S:g} s"


def per_rank(cluster: RaySettings, device: DeviceKind) -> dict[str, float]:
    """What one rank reserves: CPUs, GPUs (a cuda group: 1 by default) and the cluster's custom
    resources."""
    gpus = cluster.gpus_per_rank
    if gpus is None:
        gpus = 1.0 if device == DeviceKind.CUDA else 0.0
    wants = {"CPU": cluster.cpus_per_rank, "GPU": gpus, **cluster.resources_per_rank}
    return {k: v for k, v in wants.items() if v}


def bundles(
    cluster: RaySettings, nproc: int, nodes: int, device: DeviceKind
) -> list[dict[str, float]]:
    """One bundle per node of the group, holding that node's ranks."""
    share = nproc // nodes
    return [{k: v * share for k, v in per_rank(cluster, device).items()} for _ in range(nodes)]


def check_fits(ray: Any, name: str, cluster: RaySettings, group: str, sized: Sized) -> None:
    """Refuse a group that no choice of the cluster's live nodes holds (each bundle on a node
    of its own), naming what it asks and what the nodes have."""
    bundle = bundles(cluster, sized.nproc, sized.nodes, sized.device)[0]
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    holding = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    if len(holding) >= sized.nodes:
        return
    have = "; ".join(
        f"{n.get('NodeManagerHostname', '?')}: "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(n["Resources"].items()) if _shown(k))
        for n in nodes
    )
    want = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
    each = ", ".join(f"{k} {v:g}" for k, v in per_rank(cluster, sized.device).items())
    raise PlacementError(
        f"group {group!r} cannot be placed on Ray cluster {name!r}: it needs {sized.nodes} "
        f"node(s) with {want} each ({sized.nproc} rank(s) of {each}), and {len(holding)} of "
        f"its {len(nodes)} live node(s) have that (nodes: {have}); lower clusters.{name}."
        f"cpus_per_rank / gpus_per_rank / resources_per_rank or placement.{group}.nproc"
    )


def check_groups(name: str, cluster: RaySettings, groups: dict[str, Sized]) -> None:
    """Before anything starts: the cluster answers, and can hold each of ``groups``."""
    ray = import_ray()
    connect(ray, name, cluster)  # the launcher's driver later is this one
    for group, sized in groups.items():
        check_fits(ray, name, cluster, group, sized)
