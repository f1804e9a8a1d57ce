"""The manual launcher starts nothing: it announces the command that joins each group (token,
group, layout, CURVE client keys), announces it again when the supervisor restarts the group,
and says the group is started by hand."""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

from controller.placement import GroupSpec, RoleSpec
from deploy.launchers.base import Launcher, Where
from deploy.launchers.manual import ManualLauncher


def test_the_command_is_announced_at_start_and_again_at_a_restart(tmp_path: Path) -> None:
    said: list[tuple[str, str]] = []
    group = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")}, nproc=2, tp=2)
    launcher: Launcher = ManualLauncher(
        "tcp://10.0.0.1:5555", "tok", tmp_path / "keys", lambda g, c: said.append((g.name, c))
    )
    launcher.start([group])
    asyncio.run(launcher.restart(group))
    asyncio.run(launcher.stop())
    assert [name for name, _ in said] == ["gen", "gen"] and said[0] == said[1]
    words = shlex.split(said[0][1])
    assert words[:3] == ["HYBRIDFLOW_TOKEN=tok", "hybridflow", "role"]
    assert words[words.index("--connect") + 1] == "tcp://10.0.0.1:5555"
    assert words[words.index("--tp") + 1] == "2" and words[words.index("--nproc") + 1] == "2"
    assert words[-4:] == ["--keys", str(tmp_path / "keys"), "--client", "gen"]
    assert launcher.where() == [Where("gen", None, "started by hand")]
    assert launcher.stopping
