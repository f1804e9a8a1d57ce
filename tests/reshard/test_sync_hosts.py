"""``auto`` paths between role groups that look like other hosts and clusters
(``HYBRIDFLOW_HOST_ID`` and ``HYBRIDFLOW_CLUSTER`` per group, all on this machine): another host
of the same cluster gets the stateless gloo group, another cluster ZeroMQ over TCP with CURVE.
The weights arrive bitwise either way."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from controller.clients import ActorClient
from controller.placement import GroupSpec
from controller.server import Controller
from controller.sync import WeightSync
from deploy.launchers.local import LocalLauncher, SocketFolder
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.sync import ProbedRolloutClient
from tests.reshard.test_sync import expected_digests, perturbed
from transport.weight_sync import WeightSyncSettings

PLACES = {  # group: (host, cluster)
    "a": ("host-a", "one"),
    "r": ("host-b", "one"),
    "x": ("host-c", "two"),
}


@asynccontextmanager
async def spread_session(groups: list[GroupSpec]) -> AsyncIterator[Controller]:
    """``local_session`` with each group's host and cluster set as ``PLACES`` says."""
    folder = SocketFolder()
    controller = Controller(groups, TEST_TIMEOUTS)
    launcher: LocalLauncher | None = None
    try:
        address = controller.bind(f"ipc://{folder.path}/controller")
        launcher = LocalLauncher(
            address,
            controller.token,
            folder.path,
            folder.path,
            TEST_TIMEOUTS,
            controller.report_exit,
        )
        controller.local_groups = {g.name for g in groups}
        for spec in groups:
            host, cluster = PLACES[spec.name]
            launcher.start_group(spec, {"HYBRIDFLOW_HOST_ID": host, "HYBRIDFLOW_CLUSTER": cluster})
        await controller.wait_ready()
        yield controller
    finally:
        if launcher is not None:
            launcher.stopping = True
        await controller.shutdown()
        if launcher is not None:
            await launcher.stop()
        folder.remove()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = str(init_model(tmp_path_factory.mktemp("hosts") / "tiny", "tiny", seed=0))
    rollout = ("tests.fixtures.sync:ProbedRollout", {"model": model})
    placement = [
        group("a", 2, actor=("roles.actor:Actor", {"model": model, "micro_batch_size": 4})),
        group("r", 2, rollout=rollout),
        group("x", 2, tp=2, rollout_far=rollout),
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with spread_session(placement) as c:
            actor = ActorClient(c, "actor")
            weights = perturbed(await actor.state_dict(), 3)
            await actor.load_state(weights)
            sync = WeightSync(actor, WeightSyncSettings(bucket_mb=0.25, stall_s=20))
            for name, layout in (("rollout", (2, 1)), ("rollout_far", (1, 2))):
                client = ProbedRolloutClient(c, name)
                got = await sync.push(client, 3)
                out[name] = {
                    "paths": got["sent"]["paths"],
                    "digests": await client.digests(),
                    "expected": expected_digests(weights, *layout),
                }
        return out

    found: dict[str, Any] = run(main)
    return found


@pytest.mark.timeout(300)
def test_another_host_of_the_same_cluster_takes_the_stateless_group(
    results: dict[str, Any],
) -> None:
    near = results["rollout"]
    assert set(near["paths"].values()) == {"group"}
    assert near["digests"] == near["expected"]


def test_another_cluster_takes_zeromq_over_curve(results: dict[str, Any]) -> None:
    far = results["rollout_far"]
    assert set(far["paths"].values()) == {"zmq"}
    assert far["digests"] == far["expected"]
