"""The library's loop with its groups on a cluster: ``examples/api/grpo.py --clusters`` with the
rollout group in a job of the one-node SLURM cluster of .ci/slurm-up (the script's machine is the
login node). Every GRPO batch comes from the weights the actor had just trained, and the job is
gone when the script ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_multicluster import WITH_ROLLOUT, our_jobs, rank_processes, settle, slurm

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["slurm"]  # the fixture


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_grpo_loop_with_its_rollout_group_in_a_slurm_job(slurm: None, tmp_path: Path) -> None:
    spec = tmp_path / "clusters.yaml"
    spec.write_text((ROOT / "examples" / "clusters" / "here_and_slurm.yaml").read_text())
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(ROOT / "examples" / "api" / "grpo.py"), "--run-dir", str(run_dir)]
    argv += ["--sft-steps", "20", "--steps", "3", "--prompts", "8", "--n", "4", "--val", "16"]
    argv += ["--clusters", str(spec)] + [x for s in WITH_ROLLOUT for x in ("--set", s)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("after GRPO: ")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if "train/weight_version" in r]
    # 20 SFT steps, then each GRPO batch sampled in the job from the newest version
    assert [(r["step"], r["train/weight_version"]) for r in grpo] == [(21, 20), (22, 21), (23, 22)]
    assert len(list((run_dir / "farm").glob("slurm-*.out"))) == 1  # the job's own output
    assert settle(our_jobs) == []
    assert settle(lambda: rank_processes(tmp_path)) == []
