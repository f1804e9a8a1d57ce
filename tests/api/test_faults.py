"""Faults below the user's loop (``bench/api_chaos.py``): a policy-gradient loop written against
``hybridflow.mesh`` loses a reward rank, the actor's rank 0 between two ``forward_backward``
calls of an accumulated step, before an ``optim_step`` and while the snapshot after one is
taken, and a rollout rank, and still ends with the weights, rewards and policy version of the
undisturbed loop, bitwise. Without the replay of the accumulated call, or without the snapshot
restore, the weights differ (checked by hand when this was written: both give
``api_chaos_equal: false``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.api_chaos import compare
from deploy.processes import alive


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_loop_survives_a_kill_of_each_group_kind_with_equal_weights(tmp_path: Path) -> None:
    found = asyncio.run(compare(tmp_path, steps=3))
    assert found["api_chaos_kills"] == 5
    assert found["api_chaos_rollbacks"] == 3  # the actor's deaths; the others restart alone
    assert found["api_chaos_equal"], found
    # each fault and its recovery is a record of the run's metrics, as under hybridflow run
    lines = (tmp_path / "chaos" / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(x) for x in lines if '"event"' in x]
    assert sorted(e["event"] for e in events if e["event"] != "restart") == [
        *["fault"] * 5,
        *["rollback"] * 3,
    ], events
    assert {e["group"] for e in events if e["event"] == "fault"} == {"score", "main", "gen"}
    ranks = json.loads((tmp_path / "chaos" / "processes.json").read_text())["ranks"]
    assert len(ranks) == 4  # the restarted ones included, and none outlived the mesh
    assert not [r for r in ranks if alive(r["pid"])]
