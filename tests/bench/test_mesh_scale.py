"""The simulated mesh (bench/mesh_scale.py): the real controller talks to each group once per
call, whatever the number of ranks behind its coordinator, and every coordinator ends."""

from __future__ import annotations

import pytest

from bench.mesh_scale import measure

pytestmark = pytest.mark.timeout(180)


def test_controller_sends_one_message_per_group_whatever_the_ranks_behind() -> None:
    rows = {(g, r): measure(g, r, calls=30, warmup=5) for g in (1, 6) for r in (1, 4)}
    for (g, r), row in rows.items():
        assert row["ctrl_msgs_per_call"] == g
        assert row["ctrl_replies_per_call"] == g
        assert row["rank_msgs_per_call"] == g * (r - 1)  # the fan-out happened behind it
    for g in (1, 6):
        one, four = rows[(g, 1)], rows[(g, 4)]
        # same messages to the same groups: the bytes differ only by the call ids' widths
        assert abs(four["ctrl_bytes_per_call"] - one["ctrl_bytes_per_call"]) <= 2 * g
        # the controller's CPU per call does not follow the ranks (loose: a shared 2-core VM)
        assert four["ctrl_cpu_us_per_call"] < 2.5 * one["ctrl_cpu_us_per_call"]
    # more groups cost the controller more CPU per call
    assert rows[(1, 1)]["ctrl_cpu_us_per_call"] < rows[(6, 1)]["ctrl_cpu_us_per_call"]
