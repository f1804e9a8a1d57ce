"""The ``ray`` launcher: a group's ranks as actors on a Ray cluster, placed by a placement group.

Ray only launches here. It finds the nodes, reserves a group's CPUs and GPUs, starts each rank and
says when one is gone; the ranks then meet and talk as under every other launcher — calls,
batches and weights on the mesh's own msgpack/ZeroMQ links, CURVE when they leave a host. Nothing
of the run goes through Ray's object store; the actors only carry a command line, its
environment and the group's token (the token never on a command line).

* **Placement.** A group of ``nproc`` ranks over ``nodes`` nodes becomes one placement group of
  ``nodes`` bundles, each holding one node's ranks (``nproc / nodes`` times the cluster's
  ``cpus_per_rank``, ``gpus_per_rank`` and ``resources_per_rank``), ``STRICT_SPREAD`` over
  distinct nodes (a group on one node: one bundle). Rank ``r`` takes its share of bundle
  ``r // (nproc / nodes)``: ranks fill the nodes in order, so tensor-parallel peers share one,
  as the other launchers lay them. (Ray has no strategy for "R bundles on each of K nodes"; a
  bundle a node says it exactly.) A group no set of the cluster's nodes can hold is refused
  before anything starts, naming what it asked for and what the nodes have; one that is not
  placed within ``placement_timeout_s`` (the cluster busy) is refused with Ray's state of it.
* **Ranks.** Each rank is a small actor (``RankActor``) that runs ``hybridflow role ...
  --launcher env`` as its child with the rank's variables (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``: rank 0's node address, loopback for a group on one node,
  ``MASTER_PORT``: a port free there),
  its output appended to the run's ``logs/GROUP-RANK.log``, the token on its stdin; the child
  dies with its actor (``PR_SET_PDEATHSIG``).
* **Supervision.** A rank that exits non-zero, or whose actor dies (a node lost, ``ray kill``),
  is reported to the controller at once with its node and its log's last error line; a restart
  kills the group's actors and starts new ones in the same placement group (the reservation is
  kept). At the end every actor and placement group the run made is removed, whatever the
  ending.

The driver (``ray.init``) runs in the controller's process; ``address`` is ``auto`` (a cluster
this machine belongs to), ``HOST:PORT`` (a head's GCS) or ``ray://HOST:10001`` (Ray Client).
Never ran: a Ray cluster over several machines, GPUs, KubeRay.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.placement import GroupSpec
from deploy.launchers.base import DeathCallback, Where, begin_log, last_error, role_argv
from deploy.launchers.rayplace import (
    PlacementError,
    bundles,
    check_fits,
    connect,
    import_ray,
    joined,
    per_rank,
)
from deploy.processes import write_processes
from reshard.peers import CLUSTER_ENV
from roles.runtime.env import RankVar
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts

if TYPE_CHECKING:
    from deploy.clusters import RayCluster

log = logging.getLogger("hybridflow.launcher")

ACTOR_PREFIX = "hybridflow:"  # rank actors are named hybridflow:CLUSTER:GROUP:RANK:N


class RankActor:
    """One rank on a Ray node: runs its ``hybridflow role`` process and waits for it. Ray makes
    it a remote class (``_actor_class``); its methods run in the actor's process there."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log, self.log_start = "", 0  # the rank's log on this node, this run's offset in it

    def node(self) -> tuple[str, str, int, str]:
        """(this node's address, its host name, a TCP port free here, Ray's id of the node):
        where rank 0 meets, and what a fault names."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return address, socket.gethostname(), port, ray.get_runtime_context().get_node_id()

    def start(self, argv: list[str], env: dict[str, str], token: str, log: str, cwd: str) -> int:
        """Start the rank (its pid); it dies with this actor. Its log is ``log`` on this node,
        a relative one under ``cwd`` (the rank's working folder, where its run folder is)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("a rank actor must start its rank from its main thread")
        libc = ctypes.CDLL(None)
        self.log = os.path.join(cwd, log)
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        self.log_start = begin_log(Path(self.log))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **env},
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: libc.prctl(1, signal.SIGKILL, 0, 0, 0),  # PR_SET_PDEATHSIG
            )
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{token}\n".encode())
        self.proc.stdin.close()
        return self.proc.pid

    def wait(self) -> tuple[int, str]:
        """The rank's exit status once it ends (negative: the signal), and the last error line
        of its log, read here: the controller may not see this node's files."""
        assert self.proc is not None
        code = self.proc.wait()
        return code, last_error(Path(self.log), self.log_start)


_actor_classes: dict[int, Any] = {}


def _actor_class(ray: Any) -> Any:
    """``RankActor`` as a Ray actor class (made once per ``ray`` module). One call at a time,
    on the actor process's main thread: the rank it starts dies with the thread that started
    it (``PR_SET_PDEATHSIG`` follows the thread), which lives as long as the actor."""
    key = id(ray)
    if key not in _actor_classes:
        _actor_classes[key] = ray.remote(max_restarts=0)(RankActor)
    return _actor_classes[key]


@dataclass
class _Rank:
    group: str
    rank: int
    actor: Any
    log_path: Path  # as the rank's node sees it (relative: under the rank's working folder)
    name: str  # the actor's
    node: str = ""  # the node's host name
    address: str = ""  # the node's address
    node_id: str = ""  # Ray's id of the node (ray list nodes, the dashboard)
    pid: int = 0  # the rank's, on that node
    watch: asyncio.Task[None] | None = None


@dataclass
class _Group:
    spec: GroupSpec
    placement: Any  # Ray's PlacementGroup
    ranks: list[_Rank] = field(default_factory=list)


class RayLauncher:
    """Groups on a Ray cluster: a placement group each, a Ray actor per rank (``Launcher``)."""

    def __init__(
        self,
        name: str,
        cluster: RayCluster,
        run_dir: Path,
        keys: Path | None,
        timeouts: Timeouts,
        on_dead: DeathCallback,
        address: str,
        token: str,
    ) -> None:
        self.name, self.cluster, self.run_dir = name, cluster, run_dir
        self.address, self.token = address, token  # what the groups join
        self.keys = cluster.keys or (str(keys) if keys is not None else None)
        self.timeouts, self.on_dead = timeouts, on_dead
        self.groups: dict[str, _Group] = {}
        self.stopping = False
        self.started = 0  # actors started so far
        self.ray = import_ray()
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def per_rank(self, spec: GroupSpec) -> dict[str, float]:
        return per_rank(self.cluster, spec.device)

    def bundles(self, spec: GroupSpec) -> list[dict[str, float]]:
        return bundles(self.cluster, spec.nproc, spec.nodes, spec.device)

    def check_fits(self, spec: GroupSpec) -> None:
        check_fits(self.ray, self.name, self.cluster, spec.name, spec)

    def place(self, spec: GroupSpec) -> Any:
        """The group's placement group, reserved (waits ``placement_timeout_s``)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        self.check_fits(spec)
        strategy = "STRICT_SPREAD" if spec.nodes > 1 else "PACK"
        pg = placement_group(
            self.bundles(spec), strategy=strategy, name=f"hybridflow-{self.name}-{spec.name}"
        )
        limit = self.cluster.placement_timeout_s
        try:
            self.ray.get(pg.ready(), timeout=limit)
        except self.ray.exceptions.GetTimeoutError:
            state = self.ray.util.placement_group_table(pg)
            remove_placement_group(pg)
            raise PlacementError(
                f"group {spec.name!r} was not placed on Ray cluster {self.name!r} within "
                f"{limit:g} s (clusters.{self.name}.placement_timeout_s): Ray says its "
                f"placement group is {state.get('state', '?')} (bundles {self.bundles(spec)}, "
                f"strategy {strategy}); the cluster is busy or lacks those resources"
            ) from None
        return pg

    # -- the Launcher interface -----------------------------------------------------------------

    def start(self, groups: Sequence[GroupSpec]) -> None:
        connect(self.ray, self.name, self.cluster)
        for spec in groups:  # every group fits before any is placed
            self.check_fits(spec)
        for spec in groups:
            group = _Group(spec, self.place(spec))
            self.groups[spec.name] = group  # placed: removed at stop even if the start fails
            self._start_ranks(group)
            self._watch_ranks(group)

    def _start_ranks(self, group: _Group) -> None:
        """Start an actor per rank in the group's bundles, rank 0 first: its node's address
        and a port free there are where the group meets. Blocks on Ray (a restart runs it in a
        thread of its own)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec, ray = group.spec, self.ray
        share = spec.nproc // spec.nodes
        per_rank = self.per_rank(spec)
        actor_class = _actor_class(ray)
        group.ranks = []
        for rank in range(spec.nproc):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group.placement, placement_group_bundle_index=rank // share
            )
            name = self._actor_name(spec.name, rank)  # `ray list actors` says whose it is
            actor = actor_class.options(
                num_cpus=per_rank.get("CPU", 0),
                num_gpus=per_rank.get("GPU", 0),
                resources={k: v for k, v in per_rank.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=strategy,
                name=name,
            ).remote()
            log_path = self.run_dir / "logs" / f"{spec.name}-{rank}.log"
            group.ranks.append(_Rank(spec.name, rank, actor, log_path, name))
        places = ray.get([r.actor.node.remote() for r in group.ranks], timeout=self._join_s())
        master, _, port, _ = places[0]
        if spec.nodes == 1:  # one bundle, so one node: the ranks meet on loopback, as here
            master = "127.0.0.1"
        for r, (address, host, _, node_id) in zip(group.ranks, places, strict=True):
            r.address, r.node, r.node_id = address, host, node_id
        starts = [
            r.actor.start.remote(
                self._argv(spec, master, port),
                self._env(spec, r.rank, share),
                self.token,
                str(r.log_path),
                self.cluster.workdir or str(Path.cwd()),
            )
            for r in group.ranks
        ]
        for r, pid in zip(group.ranks, ray.get(starts, timeout=self._join_s()), strict=True):
            r.pid = int(pid)

    def _watch_ranks(self, group: _Group) -> None:
        for r in group.ranks:
            r.watch = asyncio.get_running_loop().create_task(self._watch(group, r))
        self._write_processes()

    def _actor_name(self, group: str, rank: int) -> str:
        self.started += 1  # a restart's actors get names of their own
        return f"{ACTOR_PREFIX}{self.name}:{group}:{rank}:{self.started}"

    def _join_s(self) -> float:
        return max(self.timeouts.group_init_s, self.cluster.placement_timeout_s)

    def _argv(self, spec: GroupSpec, master: str, port: int) -> list[str]:
        python = self.cluster.python or sys.executable
        argv = role_argv(spec, self.address, str(self.run_dir), self.keys)
        argv += ["--launcher", "env", "--master-addr", master, "--master-port", str(port)]
        return [python, "-m", "deploy.cli", *argv, "--token", "-"]

    def _env(self, spec: GroupSpec, rank: int, share: int) -> dict[str, str]:
        gpus = self.per_rank(spec).get("GPU", 0)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(spec.nproc),
            # Ray shows each GPU actor only its own GPUs: a rank's first visible one is its
            "LOCAL_RANK": "0" if gpus else str(rank % share),
            TIMEOUTS_ENV: self.timeouts.to_env(),
            RankVar.THREADS: str(spec.threads),
            CLUSTER_ENV: self.name,  # weight syncs pick paths by it (reshard/peers.py)
        }

    async def _watch(self, group: _Group, r: _Rank) -> None:
        """Report the rank's end: its exit status, or its actor's death."""
        try:
            code, said = await r.actor.wait.remote()
            cause = f"exited with {code}: {said}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # RayActorError: the actor (or its node) is gone
            code = -signal.SIGKILL
            cause = f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        if self.stopping or code == 0 or r not in group.ranks:
            return  # the shutdown, a clean exit, or an incarnation a restart replaced
        where = f"on Ray cluster {self.name!r}, node {r.node} ({r.address}, Ray node {r.node_id})"
        self.on_dead(r.group, r.rank, f"{where} {cause} (log: {r.log_path} on {r.node})")

    async def restart(self, spec: GroupSpec) -> None:
        """Kill the group's actors (their ranks die with them), wait until they are gone, wait
        for Ray to have the placement group placed again (a bundle of a lost node goes to
        another, a joining one included), and start new actors in it. Ray's calls run in a
        thread: the other groups' calls go on meanwhile."""
        group = self.groups[spec.name]
        old, group.ranks = group.ranks, []  # from here on their ends are no deaths
        await self._kill(old)
        await asyncio.to_thread(self._placed_again, group)
        try:
            await asyncio.to_thread(self._start_ranks, group)
        except Exception as exc:  # Ray's errors run to a dozen lines: the first says it
            said = str(exc).strip().splitlines()
            raise RuntimeError(
                f"the ranks of group {spec.name!r} did not start on Ray cluster {self.name!r}: "
                f"{type(exc).__name__}: {said[0] if said else ''}"
                + (f" ({said[-1].strip()})" if len(said) > 1 else "")
            ) from None
        self._watch_ranks(group)

    def _placed_again(self, group: _Group) -> None:
        """Wait until Ray says the group's placement group is CREATED, within
        ``placement_timeout_s``; PlacementError naming it and Ray's state otherwise."""
        limit = self.cluster.placement_timeout_s
        deadline = time.monotonic() + limit
        state = "?"
        while time.monotonic() < deadline:
            table = self.ray.util.placement_group_table(group.placement)
            state = table.get("state", "?")
            alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
            on = set(table.get("bundles_to_node_id", {}).values())
            if state == "CREATED" and on <= alive:  # Ray may not have seen a node's loss yet
                return
            time.sleep(0.2)  # Ray has no wait for a placement group placed again
        raise PlacementError(
            f"group {group.spec.name!r} was not placed again on Ray cluster {self.name!r} "
            f"within {limit:g} s (clusters.{self.name}.placement_timeout_s): Ray says its "
            f"placement group is {state} (bundles {self.bundles(group.spec)}); a lost node's "
            "share waits for a node that can hold it"
        )

    async def _kill(self, ranks: list[_Rank]) -> None:
        for r in ranks:
            self.ray.kill(r.actor, no_restart=True)
        watches = [r.watch for r in ranks if r.watch is not None]
        if watches:
            _, pending = await asyncio.wait(watches, timeout=self.timeouts.shutdown_s + 5.0)
            if pending:
                left = [(r.group, r.rank) for r in ranks if r.watch in pending]
                raise RuntimeError(f"ranks {left} on Ray cluster {self.name!r} would not die")

    async def stop(self) -> None:
        """The groups leave on the controller's SHUTDOWN; after the grace period every actor
        is killed and every placement group removed."""
        from ray.util.placement_group import remove_placement_group

        self.stopping = True
        ranks = [r for g in self.groups.values() for r in g.ranks]
        watches = [r.watch for r in ranks if r.watch is not None]
        if watches:
            await asyncio.wait(watches, timeout=self.timeouts.shutdown_s + 5.0)
        try:
            await self._kill(ranks)
        finally:
            for group in self.groups.values():
                remove_placement_group(group.placement)
            self.groups.clear()
            if self.name in joined:  # joined for this run: leave (a caller's own driver stays)
                joined.remove(self.name)
                self.ray.shutdown()

    def _write_processes(self) -> None:
        """This cluster's ranks in ``RUN_DIR/processes.json`` (``hybridflow status``): node,
        the rank's pid there, its actor."""
        ranks = [
            {
                "group": r.group,
                "rank": r.rank,
                "roles": list(g.spec.roles),
                "pid": r.pid,
                "host": r.node,
                "address": r.address,
                "ray_node": r.node_id,
                "actor": r.name,
                "log": str(r.log_path),
            }
            for g in self.groups.values()
            for r in g.ranks
        ]
        write_processes(self.run_dir, ranks, cluster=self.name)

    def where(self) -> list[Where]:
        return [
            Where(r.group, r.rank, f"{r.node} ({r.address}, Ray node {r.node_id}, actor {r.name})")
            for g in self.groups.values()
            for r in g.ranks
        ]

    def hint(self) -> str:
        return f"the Ray cluster {self.name!r} ({self.cluster.address}): `ray status` there"
