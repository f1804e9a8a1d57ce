"""The suite's own guard: under HYBRIDFLOW_REQUIRE_SYSTEM_TESTS=1 a missing component fails."""

from __future__ import annotations

import pytest

from tests.conftest import require_system


def test_missing_component_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDFLOW_REQUIRE_SYSTEM_TESTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="slurmctld is not available"):
        require_system("slurmctld", False, "apt-get install slurm-wlm")
    monkeypatch.setenv("HYBRIDFLOW_REQUIRE_SYSTEM_TESTS", "1")
    with pytest.raises(pytest.fail.Exception, match="forbids skipping"):
        require_system("slurmctld", False, "apt-get install slurm-wlm")
    require_system("slurmctld", True, "")  # present: nothing happens
