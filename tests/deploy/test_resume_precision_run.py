"""A run's checkpoint records each role's resolved dtype; resuming on a start where
``dtype: auto`` resolves otherwise is refused (exit 1, the role and both dtypes named), and the
setting the refusal names resumes it in the recorded precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.trainer import checkpoints
from roles.runtime.device import AUTO_DTYPE_ENV
from tests.deploy.test_run import job, quick_argv, summary


@pytest.mark.slow
@pytest.mark.extended  # tests/controller/test_resume_precision.py checks the refusal itself
@pytest.mark.timeout(300)
def test_a_resume_in_another_precision_is_refused_until_the_dtype_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bf16")
    assert job(quick_argv("quickstart.yaml", run_dir, [], "--stop-after", "3")) == 0
    (saved,) = checkpoints(run_dir / "checkpoints")
    recorded = json.loads((saved / "controller.json").read_text())["precision"]
    assert recorded["actor"]["dtype"] == "bf16"

    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp32")  # the measurement flipped
    resume = ["run", "--resume", "--run-dir", str(run_dir)]
    capfd.readouterr()
    assert job(resume) == 1
    said = " ".join(capfd.readouterr().err.split())
    assert "role 'actor' computed in bf16 then, now in fp32" in said
    assert "--set roles.actor.dtype=bf16" in said

    assert job([*resume, "--set", "roles.actor.dtype=bf16"]) == 0
    assert summary(run_dir)["precision"]["actor"]["dtype"] == "bf16"
