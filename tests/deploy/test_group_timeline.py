"""Every role group's work is on the step timeline: a PPO run's critic group, which only computes
values and trains the critic, shows busy spans in the records, an idle share under 100% in the
live view, and lanes of its own in the report's timeline."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from deploy.experiment import load
from deploy.reports.live import LiveView, pipeline, spans
from deploy.reports.summary import timeline_spans
from tests.deploy.test_run import EXAMPLES, job, quick_argv, records

# the critic alone in its group, so that the group's busy time is the critic's
PPO = [
    "roles.reward={function: roles.rules:arithmetic_reward}",
    "placement.main={roles: [actor, reference, reward], nproc: 1}",
    "placement.value={roles: [critic], nproc: 1}",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_critic_group_is_busy_on_the_timeline(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv("ppo.yaml", run_dir, PPO)) == 0
    steps = [r for r in records(run_dir) if r["stage"] == "ppo" and "stage_step" in r]
    assert len(steps) == 2
    for record in steps:
        busy = {(stage, role): end - start for stage, role, start, end in spans(record)}
        assert busy[("compute_values", "critic")] > 0
        assert busy[("update_critic", "critic")] > 0
        assert busy[("compute_log_prob", "reference")] > 0
        assert busy[("compute_reward", "reward")] > 0
        # the actor's stages keep their names
        assert {("prepare", "actor"), ("update", "actor"), ("generate", "actor")} <= set(busy)

    exp = load(EXAMPLES / "ppo.yaml", PPO, True)
    out = io.StringIO()
    live = LiveView(exp, Console(file=out, width=200))
    assert live.group_of["critic"] == "value"
    groups = pipeline(steps, live.group_of)
    assert groups["value"]["idle"] < 1.0 and groups["main"]["idle"] < 1.0
    assert groups["value"]["last"] == ["compute_values", "update_critic"]
    for record in steps:
        live(record)
    shares = re.findall(r"idle main (\d+)% value (\d+)%", out.getvalue())
    assert shares and int(shares[-1][1]) < 100, out.getvalue()

    lanes = timeline_spans(records(run_dir))
    assert {"compute_values@critic", "update_critic@critic"} <= set(lanes)
