"""A group with no CURVE keys facing a CURVE controller is never answered (ZeroMQ refuses the
handshake before any hello): its error must say the controller may require keys, and how to
give the group some, not only that nothing answered."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.server import Controller
from deploy.launchers.local import LocalLauncher
from roles.runtime.env import RankVar
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.waiting import wait_until
from transport.security import CurveServer, make_keypair


def test_a_group_without_keys_is_told_the_controller_may_require_curve_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server_secret = make_keypair(tmp_path / "server", "controller")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for variable in (RankVar.CURVE_SECRET, RankVar.CURVE_SERVER_KEY):
        monkeypatch.delenv(str(variable), raising=False)
    timeouts = TEST_TIMEOUTS.model_copy(update={"connect_s": 3})

    async def main() -> str:
        placement = [group("main", 1, echo="tests.fixtures.roles:Echo")]
        controller = Controller(placement, timeouts)
        address = controller.bind("tcp://127.0.0.1:0", CurveServer(server_secret, allowed))
        exits: list[int] = []
        launcher = LocalLauncher(
            address,
            controller.token,
            tmp_path,
            tmp_path,
            timeouts,
            lambda g, r, c, _: exits.append(c),
        )
        launcher.start([placement[0]])
        try:
            await wait_until(lambda: exits, 30, "the keyless group gives up")
            assert exits[0] != 0
            return (tmp_path / "logs" / "main-0.log").read_text()
        finally:
            await controller.shutdown()
            await launcher.stop()

    log = run(main)
    assert "no answer from the controller" in log
    assert "the controller may require CURVE keys, and this group has none" in log
    assert "--keys DIR --client NAME" in log
