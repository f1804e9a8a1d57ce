"""The simulated mesh (bench/mesh_scale.py): the real controller talks to each group once per
call, whatever the number of ranks behind its coordinator, and every coordinator ends. The
controller's cost is compared in messages and bytes, which are exact; CPU times are not
compared (they depend on what else the machine runs)."""

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
        assert row["ctrl_cpu_us_per_call"] > 0  # reported; its size is the bench's business
    # The controller's work per call is judged by what it sends and receives, which a loaded
    # machine cannot change, not by its CPU time, which one can (2 cores shared by other jobs).
    for g in (1, 6):
        one, four = rows[(g, 1)], rows[(g, 4)]
        # same messages to the same groups: the bytes differ only by the call ids' widths
        # (a msgpack integer grows by a byte or two as the ids pass 127 and 255)
        assert abs(four["ctrl_bytes_per_call"] - one["ctrl_bytes_per_call"]) <= 2 * g
    # more groups cost the controller more: the same message once per group, six times the bytes
    for r in (1, 4):
        one, six = rows[(1, r)], rows[(6, r)]
        assert abs(six["ctrl_bytes_per_call"] - 6 * one["ctrl_bytes_per_call"]) <= 2 * 6
