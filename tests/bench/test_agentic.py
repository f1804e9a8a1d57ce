"""bench/agentic.py in its CI size (with weight pushes during a batch, and the colocated actor): the JSON line has the keys docs/agentic.md quotes, and the
simulated tool has the latency it claims. Speeds are not compared here (the machine is shared);
the idle shares are, since lock step sleeps through every turn's slowest tool whatever the load."""

from __future__ import annotations

import json

import pytest

from bench.agentic import main
from bench.agentic_env import latency

KEYS = ("traj_per_s", "lockstep_traj_per_s", "no_latency_traj_per_s", "tok_per_s",
        "generator_idle_share", "speedup_vs_lockstep", "frac_of_no_latency", "reprefill_share",
        "no_sessions_traj_per_s", "no_sessions_reprefill_share", "session_speedup",
        "prefix_reuse", "iteration_traj_per_s", "iteration_vs_continuous",
        "iteration_frac_of_no_latency", "latency_floor_s", "frac_of_floor")  # fmt: skip


def test_the_latencies_are_heavy_tailed_with_the_stated_median_and_p99() -> None:
    draws = sorted(latency(f"k/{i}") for i in range(20_000))
    assert draws[10_000] == pytest.approx(0.05, rel=0.05)
    assert draws[19_800] == pytest.approx(1.0, rel=0.12)
    assert latency("same") == latency("same")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_every_key_and_lock_step_waits_longest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--quick", "--max-staleness", "1", "--push-every-s", "0.2"]) == 0
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(isinstance(found[k], float) for k in KEYS), found
    assert found["trajectories"] == 16 and found["tool_calls_per_trajectory"] == 4
    # lock step sleeps through the slowest tool of every turn; continuous does not
    assert found["lockstep_generator_idle_share"] > found["generator_idle_share"]
    # with sessions only observations (and each turn's last sampled token) are prefilled
    assert found["reprefill_share"] <= 0.1 < found["no_sessions_reprefill_share"] < 1
    assert found["prefix_reuse"] > 0.5
    assert found["session_bytes_per_token"] == 2048  # 2 x 4 layers x 2 KV heads x 32 x 4 bytes
    # iteration-level serving keeps sessions too, and no run beats its slowest trajectory's tools
    assert found["iteration_reprefill_share"] <= 0.1
    assert 0 < found["frac_of_floor"] <= 1 and 0 < found["iteration_frac_of_floor"] <= 1
    # no serving beats the floor (its sleeps are the same draws every round: 5% for jitter)
    assert 0 < found["frac_of_no_latency"] <= found["frac_of_no_latency_bound"] * 1.05 <= 1.05
    assert 0 < found["session_speedup"] <= found["session_speedup_bound"] * 1.05
    # a weight push mid-batch drops every live session: their next turns prefill again
    assert found["stale_pushes"] >= 1
    assert found["stale_reprefill_share"] > found["reprefill_share"]
    assert isinstance(found["stale_vs_continuous"], float)
    # the colocated actor generates the same work with its own engine, its sessions kept too
    assert found["colocated_traj_per_s"] > 0 and found["colocated_prefix_hit_rate"] > 0.5
