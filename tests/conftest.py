"""Shared test helpers: bounded timeouts, a runner for async tests, system-component checks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from controller.placement import GroupSpec, RoleSpec
from roles.runtime.device import AUTO_DTYPE_ENV, cuda_devices
from transport.settings import Timeouts

# ``dtype: auto`` picks bf16 or fp32 by the CPU it runs on; the suite's numbers must not depend on
# the machine, so every rank it starts resolves auto to fp32 (tests/roles/test_precision.py
# tests the probe itself).
os.environ.setdefault(AUTO_DTYPE_ENV, "fp32")

# Every wait in tests is bounded well below pytest-timeout; process groups get <= 60 s.
TEST_TIMEOUTS = Timeouts(call_s=60, connect_s=60, group_init_s=30, shutdown_s=3)


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return uvloop.run(main())


def group(
    name: str,
    nproc: int = 1,
    tp: int = 1,
    fanout: str = "socket",
    pp: int = 1,
    **roles: str | tuple[str, dict[str, Any]],
) -> GroupSpec:
    """``group("g", 2, echo="tests.fixtures.roles:Echo")`` — a placement entry in one line
    (``tp``/``pp``: the group's tensor and pipeline sizes; dp is what remains of ``nproc``)."""
    specs = {}
    for role, value in roles.items():
        cls, config = (value, {}) if isinstance(value, str) else value
        specs[role] = RoleSpec(cls=cls, config=config)
    return GroupSpec.model_validate(
        {"name": name, "roles": specs, "nproc": nproc, "tp": tp, "pp": pp, "fanout": fanout}
    )


def require_system(component: str, available: bool, how: str) -> None:
    """Skip when a system component is missing — or fail, under HYBRIDFLOW_REQUIRE_SYSTEM_TESTS=1
    (CI), where .ci/run is expected to have installed and started it."""
    if available:
        return
    message = f"{component} is not available ({how})"
    if os.environ.get("HYBRIDFLOW_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail(f"{message}; HYBRIDFLOW_REQUIRE_SYSTEM_TESTS=1 forbids skipping")
    pytest.skip(message)


EXTENDED_ENV = "HYBRIDFLOW_EXTENDED_TESTS"
_EXTENDED_KEY = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run tests marked extended (make test-all; or HYBRIDFLOW_EXTENDED_TESTS=1)",
    )


GPU_ENV = "HYBRIDFLOW_REQUIRE_GPU"
_GPU_KEY = pytest.StashKey[int]()


def skip_gpu_tests(items: list[pytest.Item], have_gpu: bool, require: bool) -> int:
    """Tests marked ``gpu`` run where CUDA is; elsewhere they are skipped (CI has no GPU), or
    failed when ``HYBRIDFLOW_REQUIRE_GPU=1`` says this machine should have one
    (``pytest_runtest_setup``). Returns how many were skipped. ``HYBRIDFLOW_REQUIRE_SYSTEM_TESTS``
    does not apply: a GPU is no system component ``.ci/run`` can install."""
    if have_gpu or require:
        return 0
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    for item in marked:
        item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA device, none here"))
    return len(marked)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and cuda_devices() == 0:
        if os.environ.get(GPU_ENV) == "1":
            pytest.fail(f"{GPU_ENV}=1 but torch.cuda.is_available() is False: no GPU here")


#: tests that share one of the machine's system components: its SLURM cluster (jobs, squeue),
#: network namespaces and their bridges, an sshd on a fixed port, a Ray cluster. ``make test``
#: runs the suite on two pytest-xdist workers; these run one at a time, all on one of them
#: (``--dist loadgroup``), while the other takes the rest.
SERIAL = (
    "tests/api/test_remote.py",
    "tests/deploy/launchers/",
    "tests/deploy/test_cluster_restart.py",
    "tests/deploy/test_clusters.py",
    "tests/deploy/test_controller_cli.py",
    "tests/deploy/test_megatron_run.py",
    "tests/deploy/test_multicluster.py",
    "tests/deploy/test_netns.py",
    "tests/deploy/test_nodes.py",
    "tests/deploy/test_pipeline_placement.py",
    "tests/deploy/test_plan_written.py",
    "tests/deploy/test_slurm.py",
    "tests/deploy/test_slurm_nodes.py",
    "tests/deploy/test_tinker_clusters.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests are skipped without CUDA (``skip_gpu_tests``). Tests of ``SERIAL`` modules
    are one xdist group. The ``extended`` tier (slow tests another test already covers in part)
    is deselected by default and reported as such, so ``make test`` stays under 20 minutes on 2
    cores of the fast host kind."""
    config.stash[_GPU_KEY] = skip_gpu_tests(
        items, cuda_devices() > 0, os.environ.get(GPU_ENV) == "1"
    )
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.xdist_group("system"))
    if config.getoption("--extended") or os.environ.get(EXTENDED_ENV) == "1":
        return
    if config.getoption("markexpr"):  # an explicit -m decides for itself
        return
    kept = [item for item in items if item.get_closest_marker("extended") is None]
    dropped = [item for item in items if item.get_closest_marker("extended") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        config.stash[_EXTENDED_KEY] = len(dropped)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker under ``--dist loadgroup``, a grouped test's node id carries its group
    (``...@system``); one without it would run beside the other worker's system tests."""
    if not hasattr(session.config, "workerinput") or not session.config.getvalue("loadgroup"):
        return
    loose = [i.nodeid for i in session.items if i.nodeid.startswith(SERIAL) and "@" not in i.nodeid]
    if loose:
        message = (
            f"pytest-xdist's groups are not in force under this pytest ({pytest.__version__}): "
            f"{loose[0]} would run beside other system tests; install the dev extra's pins "
            "(pyproject.toml)"
        )
        print(message, file=sys.__stderr__, flush=True)  # a worker's exception reaches no one
        raise pytest.UsageError(message)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The host's fp32 matmul rate and CPU flags first (``-q`` included): two suite times
    compare only beside them (``bench/host.py``; ``.ci/run`` projects the time to the slowest
    host kind seen)."""
    from bench.host import describe

    reporter = session.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(describe())


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    skipped_gpu = config.stash.get(_GPU_KEY, 0)
    if skipped_gpu:
        terminalreporter.write_line(
            f"{skipped_gpu} gpu tests skipped: no CUDA device here (they run on a GPU machine; "
            f"{GPU_ENV}=1 makes a missing GPU a failure)"
        )
    dropped = config.stash.get(_EXTENDED_KEY, 0)
    if dropped:
        terminalreporter.write_line(
            f"{dropped} extended tests deselected (slow, partly covered by others): "
            "make test-all, or pytest --extended, runs them"
        )
