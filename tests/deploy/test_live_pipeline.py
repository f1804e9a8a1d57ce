"""The live view's pipeline panel: per group, what it ran in the last step and how idle it was.

Two hand-made step records in the trainer's timeline format (``time/timeline/<stage>@<role>``
offsets from ``time/timeline/step_start_s``), a training group and a rollout group generating one
batch ahead. Worked by hand: the window is [10, 14] s. The actor's spans cover 0.1 + 1.8 + 0.1 +
1.8 = 3.8 s of it (idle 5%). The rollout's generation of step 2's batch started before the window
(9.0-10.5, of which 0.5 s inside) and step 3's ran 10.5-12.0 (1.5 s): 2.0 s busy, idle 50%.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from deploy.reports.live import LiveView, duration, pipeline, spans

GROUPS = {"actor": "train", "reward": "train", "rollout": "gen"}


def step(k: int, start: float, parts: dict[str, tuple[float, float]]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "step": k,
        "stage": "grpo",
        "stage_step": k,
        "time/step_s": 2.0,
        "time/timeline/step_start_s": start,
        "train/staleness": 0.5 * (k - 1),
        "train/staleness_max": k - 1,
    }
    for name, (a, b) in parts.items():
        record[f"time/timeline/{name}_start_s"] = a
        record[f"time/timeline/{name}_end_s"] = b
    return record


RECORDS = [
    step(
        1,
        10.0,
        {"sync@actor": (0.0, 0.1), "update@actor": (0.1, 1.9), "generate@rollout": (-1.0, 0.5)},
    ),
    step(
        2,
        12.0,
        {"sync@actor": (0.0, 0.1), "update@actor": (0.1, 1.9), "generate@rollout": (-1.5, 0.0)},
    ),
]


def test_spans_are_absolute_seconds() -> None:
    found = sorted(spans(RECORDS[1]))
    assert found == [
        ("generate", "rollout", 10.5, 12.0),
        ("sync", "actor", 12.0, 12.1),
        ("update", "actor", 12.1, 13.9),
    ]


def test_idle_fractions_and_last_stages_by_hand() -> None:
    found = pipeline(RECORDS, GROUPS)
    assert found["train"]["last"] == ["sync", "update"]
    assert found["gen"]["last"] == ["generate"]
    assert found["train"]["idle"] == pytest.approx(0.05)
    assert found["gen"]["idle"] == pytest.approx(0.5)


def test_a_group_never_busy_is_wholly_idle_and_no_steps_give_no_fraction() -> None:
    found = pipeline(RECORDS, {**GROUPS, "critic": "value"})
    assert found["value"] == {"last": [], "idle": 1.0}
    assert pipeline([], GROUPS)["train"]["idle"] is None


def test_the_panel_names_each_group_with_its_idle_share() -> None:
    exp = SimpleNamespace(
        stages=[SimpleNamespace(name="grpo", steps=2)],
        placement={
            "train": SimpleNamespace(roles=["actor", "reward"]),
            "gen": SimpleNamespace(roles=["rollout"]),
        },
    )
    console = Console(record=True, width=120, force_terminal=False)
    view = LiveView(exp, console, enabled=False)
    for record in RECORDS:
        view(record)
    console.print(view._table())
    text = console.export_text()
    assert "group train" in text and "sync, update  idle 5% (last 2 steps)" in text
    assert "group gen" in text and "generate  idle 50% (last 2 steps)" in text
    assert "mean 0.50  max 1" in text
    assert "timeline" not in text  # the spans are not repeated in the time split row


def test_the_view_names_the_run_folder_and_the_time_left_in_the_stage(tmp_path: Path) -> None:
    exp = SimpleNamespace(
        stages=[SimpleNamespace(name="grpo", steps=10)],
        placement={"train": SimpleNamespace(roles=["actor", "reward"])},
    )
    console = Console(record=True, width=300, force_terminal=False)
    with LiveView(exp, console, every=1, run_dir=tmp_path / "run") as view:
        for k, seconds in ((1, 2.0), (2, 4.0)):  # mean 3 s a step, 8 steps left: 24 s
            view({"step": k, "stage": "grpo", "stage_step": k, "time/step_s": seconds})
        assert view.stage_left_s({"stage": "grpo", "stage_step": 10}) is None  # stage done
    lines = console.export_text().splitlines()
    assert lines[0] == f"run folder {tmp_path / 'run'}"
    assert lines[-1].endswith("stage eta 24s")
    console.print(view._table())
    text = console.export_text()
    assert "run folder" in text and "stage eta" in text and "24s" in text
    assert [duration(s) for s in (42.4, 185, 3720)] == ["42s", "3m05s", "1h02m"]
