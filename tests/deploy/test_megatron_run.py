"""``hybridflow run examples/megatron_grpo.yaml --quick``: SFT then GRPO with the actor and the
reference on the megatron engine at tp 2 x pp 2 (4 real rank processes, gloo), the actor
generating at tp 2 x pp 1 through the hybrid engine, to a valid summary and a Hugging Face export
that answers the validation problems as the run's last validation did.

The same run over two nodes of the test SLURM cluster (``hybridflow slurm --nodes 2 --submit``,
extended tier): each node holds one pipeline stage's two tensor-parallel ranks, so tensor
parallel stays inside a node and the pipeline's activations and gradients cross between the
nodes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_netns import veth_bytes_of
from tests.deploy.test_run import (
    check_export_in_plain_transformers,
    job,
    quick_argv,
    records,
    summary,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_example_quick_runs_to_a_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv("megatron_grpo.yaml", run_dir)) == 0
    check_quick_run(run_dir)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_example_quick_runs_over_two_nodes_to_a_summary(
    two_nodes: tuple[list[str], dict[str, str], str], tmp_path: Path
) -> None:
    node1, env, node2 = two_nodes
    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    argv = ["slurm", str(EXAMPLES / "megatron_grpo.yaml"), "--quick", "--nodes", "2"]
    argv += ["--keys", str(keys), "--run-dir", str(run_dir), "--submit"]
    argv += ["--set", "placement.main.nodes=2"]
    before = veth_bytes_of(node2, f"v{node2}")
    done = subprocess.run(
        [*node1, *CLI, *argv], capture_output=True, text=True, env=env, timeout=500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    crossed = veth_bytes_of(node2, f"v{node2}") - before
    steps = (run_dir / "job.sbatch").read_text().split("# group main")[1]
    assert "--nodes=2 --ntasks=4 --ntasks-per-node=2 --distribution=block" in steps
    assert "--tp 2 --pp 2" in steps
    print(f"bytes between the nodes: {crossed}")
    assert crossed > 1_000_000, crossed  # activations, gradients, the pp-1 reshard's layers
    check_quick_run(run_dir)


def check_quick_run(run_dir: Path) -> None:
    """The quick run's summary and records, and its export in plain transformers."""
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
