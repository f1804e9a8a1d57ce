"""``hybridflow report``: one panel per stage with the stage's own integer x axis, Safe-RLHF's cost
and lambda, the critics' losses, a one-screen summary with the logged answers, and ``--html``:
one self-contained page (checked by parsing it)."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import deploy.reports.summary as report
from deploy.reports.summary import run_report, stage_series, stage_spans, summary, write_report

SFT_STEPS, RL_STEPS = 40, 30


def records() -> list[dict[str, Any]]:
    """40 SFT steps, then 30 Safe-RLHF steps (reward, cost, lambda, critic losses), with
    validations at the start, before RL, every 10 RL steps and at the end."""
    rows: list[dict[str, Any]] = [{"step": 0, "stage": "init", "val/score": 0.0}]
    for k in range(1, SFT_STEPS + 1):
        rows.append({"step": k, "stage": "sft", "stage_step": k, "train/loss": 2.0 / k})
    rows.append({"step": SFT_STEPS, "stage": "before:safe", "val/score": 0.25})
    for k in range(1, RL_STEPS + 1):
        row = {
            "step": SFT_STEPS + k,
            "stage": "safe",
            "stage_step": k,
            "train/reward/mean": k / RL_STEPS,
            "train/cost": 1.0 - k / RL_STEPS,
            "train/lambda": 0.5 + 0.01 * k,
            "train/critic/loss": 1.0 / k,
            "train/cost_critic/loss": 2.0 / k,
            "time/step_s": 0.5,
        }
        if k % 10 == 0 and k < RL_STEPS:
            row["val/score"] = 0.25 + k / 100
        rows.append(row)
    rows.append({"step": SFT_STEPS + RL_STEPS, "stage": "final", "val/score": 0.75})
    return rows


SAMPLES = [
    {"step": 0, "stage": "init", "kind": "validation", "prompt": "1+1=", "response": "",
     "reward": 0.0, "answer": "2"},
    {"step": 41, "stage": "safe", "kind": "rollout", "prompt": "<b>2+2=</b>", "response": "4",
     "reward": 1.0, "answer": "4"},
    {"step": 70, "stage": "final", "kind": "validation", "prompt": "3+3=", "response": "6\nok",
     "reward": 1.0, "answer": "6"},
]  # fmt: skip


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    lines = [json.dumps(r) for r in records()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SAMPLES))
    return tmp_path


def test_each_stage_has_its_own_x_axis_from_its_first_step() -> None:
    rows = records()
    assert [(s.name, s.start, s.end) for s in stage_spans(rows)] == [
        ("sft", 0, SFT_STEPS),
        ("safe", SFT_STEPS, SFT_STEPS + RL_STEPS),
    ]
    scores = stage_series(rows, "val/score")
    assert scores["sft"] == ([0], [0.0])  # init: the first stage, at its start
    # before RL at 0, every 10 steps, the final one at the stage's last step
    assert scores["safe"] == ([0, 10, 20, 30], [0.25, 0.35, 0.45, 0.75])
    xs, _ = stage_series(rows, "train/reward/mean")["safe"]
    assert xs == list(range(1, RL_STEPS + 1))  # 1..30, not 41..70


def test_the_rl_panel_spans_its_own_steps_with_integer_ticks(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures: dict[str, Any] = {}
    save = report._save

    def keep(plt: Any, fig: Any, path: Path) -> Path:
        figures[path.name] = [(ax.get_title(), ax.get_xlim(), ax.get_xticks()) for ax in fig.axes]
        return save(plt, fig, path)

    monkeypatch.setattr(report, "_save", keep)
    written = {p.name for p in write_report(run_dir)}
    assert {"reward.png", "safety.png", "critic.png", "sft.png"} <= written
    (sft, sft_x, _), (rl, rl_x, ticks) = figures["reward.png"]
    assert sft.startswith("sft") and rl.startswith("safe (steps 41-70)")
    assert rl_x[0] < 1 and 30 <= rl_x[1] < 32  # the 30 RL steps fill their panel
    assert sft_x[1] >= 40
    assert all(float(t).is_integer() for t in ticks)
    assert [title for title, _, _ in figures["safety.png"]] == ["safe (steps 41-70)"]
    assert len(figures["critic.png"]) == 1


def test_report_prints_a_one_screen_summary_with_the_answers(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_report(run_dir) == 0
    out = capsys.readouterr().out
    assert str(run_dir / "plots" / "reward.png") in out
    text = summary(run_dir)
    assert text in out and len(text.splitlines()) <= 25
    assert "sft: 40 steps (global 1-40); last: loss 0.05" in text
    assert "safe: 30 steps (global 41-70)" in text and "cost 0" in text and "lambda 0.8" in text
    assert "init 0.000 -> before:safe 0.250 -> safe:10 0.350" in text and "final 0.750" in text
    assert "[init, step 0] '1+1=' -> ''  reward 0 (answer '2')" in text  # blanks show
    assert "'6\\nok'" in text  # so do newlines, on one line


class Page(HTMLParser):
    """What the report page holds: images, the samples table's cells, external references."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []
        self.external: list[str] = []
        self.cells: list[list[str]] = []
        self.in_samples = self.in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "img":
            self.images.append(found)
        for key in ("src", "href"):
            value = found.get(key) or ""
            if value and not value.startswith("data:"):
                self.external.append(value)
        if tag == "table" and found.get("id") == "samples":
            self.in_samples = True
        if self.in_samples and tag == "tr":
            self.cells.append([])
        if self.in_samples and tag == "td":
            self.in_cell = True
            self.cells[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.in_samples = False
        if tag == "td":
            self.in_cell = False

    def handle_data(self, data: str) -> None:
        if self.in_cell:
            self.cells[-1][-1] += data


def test_html_report_is_one_page_with_the_plots_and_the_samples(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_report(run_dir, html=True) == 0
    page_path = run_dir / "report.html"
    assert str(page_path) in capsys.readouterr().out
    page = Page()
    page.feed(page_path.read_text(encoding="utf-8"))
    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert sorted(f"{i['alt']}.png" for i in page.images) == plots
    for image in page.images:
        src = str(image["src"])
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG")  # the PNG itself
    assert page.external == []  # self-contained
    header, *rows = page.cells
    assert header == []  # the header row has th cells
    assert len(rows) == len(SAMPLES)
    assert rows[0][:5] == ["70", "final", "validation", "3+3=", "6\nok"]  # newest first
    assert rows[1][3] == "<b>2+2=</b>"  # text, not markup


def test_multi_turn_metrics_get_their_plots_and_summary_line(tmp_path: Path) -> None:
    rows = [
        {"step": k, "stage": "grpo", "stage_step": k, "train/reward/mean": 0.1 * k,
         "agent/turns": 1.0 + 0.1 * k, "agent/tool_calls": 0.5, "agent/tool_errors": 2.0,
         "agent/tool_latency_p50_s": 0.05, "agent/tool_latency_p99_s": 0.9,
         "agent/generator_idle_share": 0.2}
        for k in range(1, 6)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = [p.name for p in write_report(tmp_path)]
    assert "agent.png" in names and "tools.png" in names
    assert "turns 1.5" in summary(tmp_path) and "tool errors 2" in summary(tmp_path)
    single = {k: v for k, v in rows[0].items() if not k.startswith("agent/")}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(single) + "\n")
    assert "agent.png" not in [p.name for p in write_report(tmp_path)]  # a single-turn run
