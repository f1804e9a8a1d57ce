"""Fixtures several deploy tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import require_system
from tests.deploy.test_slurm_nodes import daemons_available, slurm_nodes


def _nodes(count: int) -> Iterator[tuple[list[str], dict[str, str], str]]:
    require_system(
        f"a {count}-node SLURM cluster in network namespaces",
        daemons_available(),
        "run as root with slurm-wlm, munge running (.ci/slurm-up) and iproute2",
    )
    with slurm_nodes(count) as cluster:
        yield cluster


@pytest.fixture
def two_nodes() -> Iterator[tuple[list[str], dict[str, str], str]]:
    """The test SLURM cluster of two nodes (``tests/deploy/test_slurm_nodes.py``): (a command
    prefix that runs on node 1, the environment naming the cluster's config, node 2's network
    namespace)."""
    yield from _nodes(2)


@pytest.fixture
def four_nodes() -> Iterator[tuple[list[str], dict[str, str], str]]:
    """The same cluster with four nodes."""
    yield from _nodes(4)
