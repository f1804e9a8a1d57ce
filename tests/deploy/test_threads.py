"""A group's intra-op threads (``placement.<group>.threads``) from the experiment YAML to
``torch.get_num_threads()`` in each of its ranks, through the local launcher and the
``hybridflow role`` command other hosts run."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.placement import GroupSpec, RoleSpec
from deploy.commands.role import RoleOptions, _group_spec
from deploy.launchers.base import role_argv
from roles.runtime.env import thread_count
from tests.deploy.test_pipeline_placement import error_of, groups_of, run_dir  # noqa: F401


def test_the_yaml_field_reaches_the_group_spec(run_dir: Path) -> None:  # noqa: F811
    [spec] = groups_of(run_dir, "placement.main.threads=2")
    assert spec.threads == 2
    [default] = groups_of(run_dir)
    assert default.threads == 1
    assert "placement.main.threads" in error_of(run_dir, "placement.main.threads=0")


def test_other_hosts_get_the_count_on_the_role_command() -> None:
    group = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")}, threads=3)
    argv = role_argv(group, "tcp://h:1", None, None)
    assert argv[argv.index("--threads") + 1] == "3"
    assert "--threads" not in role_argv(group.model_copy(update={"threads": 1}), "x", None, None)
    opts = RoleOptions(roles=("rollout",), group="gen", connect="x", threads=3)
    assert _group_spec(opts).threads == 3


def test_openmp_values_read_as_one_count(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [thread_count(v) for v in ("2", "4,1", " 3 ", "", "x", "0")] == [2, 4, 3, 1, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a hand-started group without --threads
    assert _group_spec(RoleOptions(roles=("r",), group="g", connect="x")).threads == 2


def test_each_rank_computes_with_its_groups_threads() -> None:
    """Two real groups: one of 2 ranks x 1 thread, one of 1 rank x 2 threads."""
    from deploy.session import local_session
    from tests.conftest import TEST_TIMEOUTS, run
    from tests.fixtures.clients import EchoClient

    echo = {"echo": RoleSpec(cls="tests.fixtures.roles:Echo")}
    wide = {"wide": RoleSpec(cls="tests.fixtures.roles:Echo")}
    specs = [GroupSpec(name="a", roles=echo, nproc=2), GroupSpec(name="b", roles=wide, threads=2)]

    async def main() -> None:
        async with local_session(specs, TEST_TIMEOUTS) as c:
            assert (await EchoClient(c, "echo").where())["threads"] == [1, 1]
            assert (await EchoClient(c, "wide").where())["threads"] == [2]

    run(main)
