"""``hybridflow report``'s timeline: lanes from the ``time/timeline/...`` keys of metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.reports.summary import timeline_spans, write_report


def test_timeline_lanes_are_offsets_from_each_step_start(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {
            "step": 1,
            "time/timeline/step_start_s": 10.0,
            "time/timeline/generate@rollout_start_s": -0.5,  # generated during the step before
            "time/timeline/generate@rollout_end_s": -0.25,
            "time/timeline/update@actor_start_s": 0.25,
            "time/timeline/update@actor_end_s": 1.0,
        },
        {
            "step": 2,
            "time/timeline/step_start_s": 11.0,
            "time/timeline/update@actor_start_s": 0.5,
            "time/timeline/update@actor_end_s": 0.75,
        },
        {"step": 2, "stage": "final", "val/score": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lanes = timeline_spans(rows)
    assert lanes == {
        "generate@rollout": [(9.5, 9.75)],
        "update@actor": [(10.25, 11.0), (11.5, 11.75)],
    }
    assert tmp_path / "plots" / "timeline.png" in write_report(tmp_path)
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 1000


@pytest.mark.parametrize("rows", [[{"step": 1, "train/reward/mean": 0.5}]])
def test_no_timeline_no_plot(tmp_path: Path, rows: list[dict[str, float]]) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not any(p.name == "timeline.png" for p in write_report(tmp_path))
