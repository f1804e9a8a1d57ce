"""``hybridflow plan --calibrate``: a profile measured here that the planner takes, its bad
input, and the cost model's FSDP and tensor-parallel terms by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.plan.cost import ModelShape, Strategy, Workload, all_reduce_s, pass_s
from deploy.plan.profiles import PROFILES, load_profile
from reshard.shapes import LlamaDims

ROOT = Path(__file__).resolve().parents[2]


def plan(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", "plan", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(180)
def test_calibrate_writes_a_profile_the_planner_takes(tmp_path: Path) -> None:
    out = tmp_path / "here.json"
    done = plan("--calibrate", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr
    raw = json.loads(out.read_text())
    assert json.loads(done.stdout) == raw
    profile = load_profile(str(out))
    assert profile.name == "here"
    for field in ("flops", "mem_bw", "mem_bytes", "intra_bw", "op_latency_s"):
        assert math.isfinite(getattr(profile, field)) and getattr(profile, field) > 0
    detail = raw["calibration"]
    # a training pass cannot beat the plain matmul peak by much, and reaches some of it (on an
    # AMX host the bf16 matmul peak is ~700 GFLOP/s against ~30 for a small model's training
    # pass under load: 4%; the bound is for a broken measurement, not a slow one)
    assert 0.005 < profile.flops / detail["matmul_flops"] < 1.5
    assert 1e-6 < profile.collective_latency_s < 0.5  # a loopback gloo all-reduce
    assert 1e8 < profile.mem_bw < 1e13
    done = plan(
        "examples/quickstart.yaml", "--gpus", "2", "--gpus-per-node", "2",
        "--device-profile", str(out), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["profile"] == "here" and result["plans"][0]["step_s"] > 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--calibrate", "--device-profile", "a100"], "drop --device-profile"),
        (["--out", "x.json"], "go with --calibrate"),
        ([], "give an experiment"),
        (["examples/quickstart.yaml"], "--gpus N"),
    ],
)
def test_calibrate_bad_input_is_refused_clearly(argv: list[str], says: str) -> None:
    done = plan(*argv)
    assert done.returncode == 2
    assert says in done.stderr


def test_fsdp_gathers_and_tp_reduces_by_hand() -> None:
    """One 2-layer model, 8 rows of 10 tokens, micro-batches of 2: 2 per dp replica at d = 2."""
    dims = LlamaDims(64, 128, 2, 4, 4, 100)
    m = ModelShape(dims)
    wl = Workload(models={"actor": m}, rows=8, prompt_len=6, response_len=4, micro_batch=2)
    prof = PROFILES["vm-2core"]
    s = Strategy(p=1, t=1, d=2, gen_t=1)
    # FSDP: per micro-batch (2) and pass (forward, backward) 3 units (2 layers + the root), each
    # an all-gather of a third of the weights (bf16) from the other rank, plus its latency
    one = 0.5 * (2 * m.params / 3) / prof.intra_bw + prof.collective_latency_s
    for backward, passes in ((False, 1), (True, 2)):
        plain = pass_s(m, wl, s, 2, prof, backward)
        sharded = pass_s(m, wl, s, 2, prof, backward, fsdp=True)
        assert sharded - plain == pytest.approx(2 * passes * 3 * one, rel=1e-9)
    # tp 2, d 1: 4 micro-batches of 2 x 10 tokens; per micro-batch 2 all-reduces a layer forward
    t2 = Strategy(p=1, t=2, d=1, gen_t=2)
    reduce = all_reduce_s(2 * 10 * 64 * 2, 2, prof.intra_bw, prof)
    no_tp = pass_s(m, wl, Strategy(p=1, t=1, d=1, gen_t=1), 2, prof, False)
    with_tp = pass_s(m, wl, t2, 2, prof, False)
    compute_half = no_tp - 4 * 2 * prof.op_latency_s  # compute of the pass on one device
    expected = compute_half / 2 + 4 * 2 * 2 * reduce + 4 * 2 * prof.op_latency_s
    assert with_tp == pytest.approx(expected, rel=1e-9)
