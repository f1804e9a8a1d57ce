"""``hybridflow run examples/megatron_grpo.yaml --quick``: SFT then GRPO with the actor and the
reference on the megatron engine at tp 2 x pp 2 (4 real rank processes, gloo), the actor
generating at tp 2 x pp 1 through the hybrid engine, to a valid summary and a Hugging Face export
that answers the validation problems as the run's last validation did."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.test_run import (
    check_export_in_plain_transformers,
    job,
    quick_argv,
    records,
    summary,
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_example_quick_runs_to_a_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv("megatron_grpo.yaml", run_dir)) == 0
    result = summary(run_dir)
    for key in ("val_acc_init", "val_acc_before", "val_acc_after"):
        assert 0.0 <= result[key] <= 1.0
    assert result["steps"] == 12  # 10 SFT + 2 GRPO steps
    rows = records(run_dir)
    sft = [r for r in rows if r["stage"] == "sft" and "train/loss" in r]
    assert len(sft) == 10 and sft[-1]["train/loss"] < sft[0]["train/loss"]
    rl = [r for r in rows if r["stage"] == "grpo" and "train/actor/loss" in r]
    assert [r["stage_step"] for r in rl] == [1, 2]
    assert all(r["time/reshard_s"] > 0 for r in rl)  # generated at pp 1 through reshard
    assert all(abs(r["train/kl"]) < 0.5 for r in rl)  # the reference starts at the SFT actor
    assert all(r["train/response/tokens"] > 0 for r in rl)
    check_export_in_plain_transformers(run_dir / "export" / "actor", result["val_acc_after"])
