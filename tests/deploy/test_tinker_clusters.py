"""``hybridflow serve --clusters SPEC``: a training client's group starts where a cluster spec
says, here in a job of the one-node SLURM cluster of .ci/slurm-up, and trains there as it does
on this machine; the job ends with the client's session. A spec that names what the served
experiment lacks is refused before the server listens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

tinker = pytest.importorskip("tinker")

import hybridflow as hf  # noqa: E402
from deploy.commands.serve import read_url  # noqa: E402
from roles.modeling.models import init_model  # noqa: E402
from tests.conftest import run  # noqa: E402
from tests.deploy.test_multicluster import our_jobs, settle, slurm  # noqa: E402
from tests.deploy.test_tinker import (  # noqa: E402
    ADAM,
    KEY,
    REPO,
    ROWS,
    WEIGHTS,
    close,
    datum,
    logprobs_of,
    start_server,
    stop,
)

__all__ = ["slurm"]  # the fixture


def spec(path: Path, groups: dict[str, str]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "controller": {"bind": "tcp://127.0.0.1:0", "wait": 120},
                "clusters": {"home": {"kind": "local"}, "farm": {"kind": "slurm"}},
                "groups": groups,
            }
        )
    )
    return path


@pytest.mark.timeout(300)
def test_a_clients_group_trains_in_a_slurm_job_as_it_does_here(slurm: None, tmp_path: Path) -> None:
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    run_dir = tmp_path / "serve"
    clusters = spec(tmp_path / "clusters.yaml", {"actor": "farm"})
    data = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    proc = start_server(model, run_dir, "--clusters", str(clusters))
    try:
        url = read_url(proc, timeout_s=120)
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
            trained = logprobs_of(tc.forward_backward(data, "cross_entropy").result())
            tc.optim_step(ADAM).result()
            after = logprobs_of(tc.forward(data, "cross_entropy").result())
            (folder,) = (run_dir / "models").iterdir()
            assert len(our_jobs()) == 1  # the client's group, in its job
            assert len(list((folder / "run" / "farm").glob("slurm-*.out"))) == 1
        assert settle(our_jobs) == []  # the session closed: its group and job are gone
    finally:
        stop(proc)
    here = run(lambda: on_this_machine(folder / "experiment.yaml", tmp_path / "here"))
    assert close(trained, here["trained"]) and close(after, here["after"]), (after, here)
    assert not close(after, trained, 1e-3)


async def on_this_machine(experiment: Path, run_dir: Path) -> dict[str, list[list[float]]]:
    """The same calls through ``hf.mesh`` on the client's experiment, its group here."""
    rows = [
        hf.Datum(prompt=r[:1], response=r[1:], weights=w)
        for r, w in zip(ROWS, WEIGHTS, strict=True)
    ]
    adam = hf.AdamStep(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    async with hf.mesh(experiment, "roles.actor.dtype=fp32", run_dir=run_dir) as m:
        lp = await m.log_probs(rows)
        trained = [lp[i, 1 : len(r)].tolist() for i, r in enumerate(ROWS)]
        await m.forward_backward(rows, "cross_entropy", reduction="sum")
        await m.optim_step(adam)
        lp = await m.log_probs(rows)
        return {
            "trained": trained,
            "after": [lp[i, 1 : len(r)].tolist() for i, r in enumerate(ROWS)],
        }


def test_a_spec_naming_what_the_served_experiment_lacks_is_refused_before_serving(
    tmp_path: Path,
) -> None:
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    clusters = spec(tmp_path / "clusters.yaml", {"rollout": "farm"})
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--base-model", str(model)]
    argv += ["--port", "0", "--run-dir", str(tmp_path / "serve"), "--clusters", str(clusters)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cluster spec groups.rollout: the experiment has no group or role 'rollout'" in (
        done.stderr
    )
    assert "serving" not in done.stdout
