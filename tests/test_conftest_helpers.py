"""The suite's own guards: under HYBRIDFLOW_REQUIRE_SYSTEM_TESTS=1 a missing component fails;
without CUDA the ``gpu`` tests are skipped and counted, or failed under HYBRIDFLOW_REQUIRE_GPU=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from roles.runtime.device import cuda_devices
from tests.conftest import require_system


def test_missing_component_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDFLOW_REQUIRE_SYSTEM_TESTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="slurmctld is not available"):
        require_system("slurmctld", False, "apt-get install slurm-wlm")
    monkeypatch.setenv("HYBRIDFLOW_REQUIRE_SYSTEM_TESTS", "1")
    with pytest.raises(pytest.fail.Exception, match="forbids skipping"):
        require_system("slurmctld", False, "apt-get install slurm-wlm")
    require_system("slurmctld", True, "")  # present: nothing happens


REPO = Path(__file__).resolve().parents[1]
GPU_TEST = """
import pytest

@pytest.mark.gpu
def test_on_the_gpu():
    assert False, "ran without a GPU"

def test_on_any_machine():
    pass
"""


def _pytest_with_the_suite_conftest(tmp_path: Path, env: dict[str, str]) -> str:
    """A one-file suite run with this suite's conftest as a plugin; its output."""
    (tmp_path / "test_gpu_marker.py").write_text(GPU_TEST)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"),
            *(
                "-c",
                str(REPO / "pyproject.toml"),
                "-q",
                "-rs",
                str(tmp_path / "test_gpu_marker.py"),
            ),
        ],
        cwd=REPO,
        env={**os.environ, **env, "HYBRIDFLOW_REQUIRE_SYSTEM_TESTS": "1"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    return done.stdout + done.stderr


@pytest.mark.skipif(cuda_devices() > 0, reason="the no-GPU path: this machine has a GPU")
def test_gpu_tests_are_skipped_without_cuda_and_counted_even_in_ci(tmp_path: Path) -> None:
    out = _pytest_with_the_suite_conftest(tmp_path, {"HYBRIDFLOW_REQUIRE_GPU": "0"})
    assert "1 passed, 1 skipped" in out, out
    assert "1 gpu tests skipped: no CUDA device here" in out
    assert "ran without a GPU" not in out


@pytest.mark.skipif(cuda_devices() > 0, reason="the no-GPU path: this machine has a GPU")
def test_gpu_tests_fail_without_cuda_when_a_gpu_is_required(tmp_path: Path) -> None:
    out = _pytest_with_the_suite_conftest(tmp_path, {"HYBRIDFLOW_REQUIRE_GPU": "1"})
    assert "1 passed, 1 error" in out, out
    assert "HYBRIDFLOW_REQUIRE_GPU=1 but torch.cuda.is_available() is False" in out
    assert "gpu tests skipped" not in out
