"""``hybridflow report RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` into ``RUN_DIR/plots``,
and a one-screen summary of the run (its stages, validation scores, last metrics and a few of the
answers logged in ``samples.jsonl``); ``--html`` also writes ``RUN_DIR/report.html``
(``deploy/reports/html.py``).

The line plots have one panel per stage, each with its own x axis (the step within the stage),
so 30 RL steps after 1,000 SFT steps fill a panel instead of 3% of one: reward.png (train reward
and validation score), kl.png, length.png (response length), sft.png (SFT loss), safety.png
(Safe-RLHF's episode cost and Lagrange multiplier), critic.png (value losses of the critics), and
time.png (per-step seconds split into generation, preparation, update and weight sync) and
timeline.png (when each stage ran, one lane per stage and role, from ``time/timeline/...``: the
actor's stages and every role's calls, e.g. ``update_critic@critic``; with ``max_staleness`` >= 1
on a rollout group the generation lane overlaps the update lane). A plot
whose metric the run never logged (e.g. KL without a reference) is skipped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.metrics import SAMPLES_FILE, Sample, read_records, read_samples
from deploy.reports.html import write_html

Rows = list[dict[str, Any]]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a run directory?")
    rows = [record for _, record in read_records(path)]  # a torn last line is dropped
    if not rows:
        raise ValueError(f"{path} holds no records yet")
    return rows


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    picked = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in picked], [float(v) for _, v in picked]


def write_report(run_dir: Path) -> list[Path]:
    """Draw every plot whose metrics the run logged; the PNG files written, in order."""
    rows = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    plt = _pyplot()
    written = [
        _lines(plt, rows, out / "reward.png", "reward", REWARD),
        _lines(plt, rows, out / "kl.png", "KL to reference", KL),
        _lines(plt, rows, out / "length.png", "response length (tokens)", LENGTH),
        _lines(plt, rows, out / "sft.png", "SFT loss", SFT),
        _lines(plt, rows, out / "safety.png", "Safe-RLHF: cost and lambda", SAFETY),
        _lines(plt, rows, out / "critic.png", "critic loss", CRITIC),
        _lines(plt, rows, out / "agent.png", "multi-turn: per trajectory", AGENT),
        _lines(plt, rows, out / "tools.png", "tools: latency (s) and generator idle share", TOOLS),
        _time_split(plt, rows, out / "time.png"),
        _timeline(plt, rows, out / "timeline.png"),
    ]
    return [path for path in written if path is not None]


def run_report(run_dir: Path, html: bool = False) -> int:
    """``hybridflow report RUN_DIR [--html]``: write the plots (and the page), print each file
    and the run's summary; 2, with the reason on stderr, when there is nothing to report."""
    try:
        written = write_report(run_dir)
        text = summary(run_dir)
        if html:
            written.append(write_html(run_dir, text, written))
    except (FileNotFoundError, ValueError) as exc:
        print(f"hybridflow report: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print()
    print(text)
    return 0


# -- the one-screen summary ------------------------------------------------------------------

#: (metric, how the summary names it) shown for the last step of each stage, when logged
LAST = [
    ("train/loss", "loss"),
    ("train/reward/mean", "reward"),
    ("train/kl", "kl"),
    ("train/response/length", "length"),
    ("train/cost", "cost"),
    ("train/lambda", "lambda"),
    ("train/critic/loss", "critic loss"),
    ("agent/turns", "turns"),
    ("agent/tool_calls", "tool calls"),
    ("agent/tool_errors", "tool errors"),
]
SHOWN_SAMPLES = 3  # per kind (validation, rollout): the newest


def summary(run_dir: Path) -> str:
    """What the run did, on one screen: stages, validation scores, each stage's last metrics
    and a few of the newest logged answers."""
    rows = read_metrics(run_dir)
    done = _read_json(run_dir / "summary.json")
    head = f"run {done.get('name', run_dir.name)}: {run_dir}"
    if "wall_s" in done:
        head += f" ({done.get('steps', '?')} steps in {done['wall_s']} s)"
    lines = [head, *_stage_lines(rows), *_validation_lines(rows), *_fault_lines(rows)]
    lines += _sample_lines(read_samples(run_dir / SAMPLES_FILE))
    return "\n".join(lines)


def _stage_lines(rows: Rows) -> list[str]:
    lines = []
    for span in stage_spans(rows):
        mine = [r for r in rows if r.get("stage") == span.name and "stage_step" in r]
        last = mine[-1]
        shown = [f"{name} {last[key]:.3g}" for key, name in LAST if _number(last.get(key))]
        times = [float(r["time/step_s"]) for r in mine if _number(r.get("time/step_s"))]
        if times:
            shown.append(f"{sum(times) / len(times):.2f} s/step")
        lines.append(
            f"  {span.name}: {span.end - span.start} steps (global {span.start + 1}-{span.end})"
            + (f"; last: {', '.join(shown)}" if shown else "")
        )
    return lines


def _validation_lines(rows: Rows) -> list[str]:
    found = []
    for r in rows:
        if _number(r.get("val/score")):
            tag = f"{r['stage']}:{r['stage_step']}" if "stage_step" in r else str(r["stage"])
            found.append(f"{tag} {float(r['val/score']):.3f}")
    return [f"  validation score: {' -> '.join(found)}"] if found else []


def _fault_lines(rows: Rows) -> list[str]:
    """Deaths and recoveries, when the run had any (``controller/supervisor.py``)."""
    events = [r for r in rows if "event" in r]
    if not events:
        return []
    faults = [e for e in events if e["event"] == "fault"]
    restarts = [e for e in events if e["event"] == "restart"]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    replayed = sum(int(e.get("steps_replayed", 0)) for e in rollbacks)
    slowest = max((float(e["recover_s"]) for e in restarts + rollbacks), default=0.0)
    return [
        f"  supervision: {len(faults)} fault(s), {len(restarts)} group restart(s), "
        f"{len(rollbacks)} rollback(s) ({replayed} step(s) replayed), slowest recovery "
        f"{slowest:.1f} s"
    ]


def _sample_lines(samples: list[Sample]) -> list[str]:
    lines = []
    for kind in ("validation", "rollout"):
        mine = [s for s in samples if s.get("kind") == kind]
        if not mine:
            continue
        newest = mine[-SHOWN_SAMPLES:]
        lines.append(f"  {kind} answers, newest {len(newest)} of {len(mine)} ({SAMPLES_FILE}):")
        for s in newest:
            answer = f" (answer {_clip(s['answer'], 20)})" if "answer" in s else ""
            lines.append(
                f"    [{s.get('stage')}, step {s.get('step')}] {_clip(s.get('prompt'), 40)} -> "
                f"{_clip(s.get('response'), 40)}  reward {float(s.get('reward', 0.0)):.3g}{answer}"
            )
    return lines


def _clip(value: Any, limit: int) -> str:
    """A value as the summary quotes it: repr (so blanks and newlines show), shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


# (metric, label) per line of a plot
REWARD = [("train/reward/mean", "train reward"), ("val/score", "validation")]
KL = [("train/kl", "kl"), ("train/kl_coef", "kl coef")]
LENGTH = [("train/response/length", "train")]
SFT = [("train/loss", "train"), ("val/loss", "held-out")]
SAFETY = [("train/cost", "episode cost"), ("train/lambda", "lambda")]
CRITIC = [("train/critic/loss", "critic"), ("train/cost_critic/loss", "cost critic")]
AGENT = [
    ("agent/turns", "turns"),
    ("agent/tool_calls", "tool calls"),
    ("agent/tool_call_rate", "share calling a tool"),
    ("agent/tool_errors", "tool errors (batch)"),
]
TOOLS = [
    ("agent/tool_latency_p50_s", "latency p50"),
    ("agent/tool_latency_p99_s", "latency p99"),
    ("agent/generator_idle_share", "generator idle share"),
]
TIME_PARTS = ("gen", "prepare", "update", "sync")


def _pyplot() -> Any:
    """matplotlib's pyplot without a display (imported here: plotting is this command's only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class StageSpan:
    """A stage of the run as its records show it: global steps ``start`` (before its first
    step) to ``end``."""

    name: str
    start: int
    end: int


def stage_spans(rows: Rows) -> list[StageSpan]:
    """The stages that logged steps, in the order they ran."""
    found: dict[str, StageSpan] = {}
    for r in rows:
        if "stage_step" not in r:
            continue
        name, start, step = str(r["stage"]), int(r["step"]) - int(r["stage_step"]), int(r["step"])
        old = found.get(name, StageSpan(name, start, step))
        found[name] = StageSpan(name, min(old.start, start), max(old.end, step))
    return sorted(found.values(), key=lambda span: (span.start, span.end))


def stage_of(record: dict[str, Any], spans: Sequence[StageSpan]) -> StageSpan | None:
    """The stage a record belongs to: its own, or for a validation the one its tag names
    (``before:NAME``; ``init`` the first, ``final`` the last), else the one holding its step."""
    if not spans:
        return None
    tag = str(record.get("stage", ""))
    named = {span.name: span for span in spans}
    if tag in named:
        return named[tag]
    if tag.startswith("before:") and tag[len("before:") :] in named:
        return named[tag[len("before:") :]]
    if tag == "init":
        return spans[0]
    if tag == "final":
        return spans[-1]
    step = int(record.get("step", 0))
    return next((span for span in spans if span.start <= step <= span.end), None)


def stage_series(rows: Rows, key: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per stage: (step within the stage, value) of every record holding ``key``."""
    spans = stage_spans(rows) or [StageSpan("run", 0, max(int(r["step"]) for r in rows))]
    found: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        value, span = r.get(key), stage_of(r, spans)
        if isinstance(value, int | float) and span is not None:
            xs, ys = found.setdefault(span.name, ([], []))
            xs.append(int(r["step"]) - span.start)
            ys.append(float(value))
    return found


def _lines(
    plt: Any, rows: Rows, path: Path, title: str, lines: list[tuple[str, str]]
) -> Path | None:
    """One panel per stage that logged any of ``lines``, one line per metric, x the step within
    the stage; None (nothing drawn) when the run logged none of them."""
    drawn = {label: stage_series(rows, key) for key, label in lines}
    spans = stage_spans(rows) or [StageSpan("run", 0, 0)]
    panels = [s for s in spans if any(s.name in per_stage for per_stage in drawn.values())]
    if not panels:
        return None
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(7, 4.5 * len(panels)), 4), squeeze=False, sharey=True
    )
    for ax, span in zip(axes[0], panels, strict=True):
        for color, (label, per_stage) in enumerate(drawn.items()):
            if span.name in per_stage:
                xs, ys = per_stage[span.name]
                marker = "." if len(xs) < 30 else None
                ax.plot(xs, ys, label=label, color=f"C{color}", marker=marker)
        width = max(1, span.end - span.start)
        ax.set_xlim(-0.03 * width, 1.03 * width)  # the whole stage, whatever it logged
        ax.set_title(f"{span.name} (steps {span.start + 1}-{span.end})", fontsize=10)
        ax.set_xlabel("step in stage")
        _integer_ticks(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path)


def _integer_ticks(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _time_split(plt: Any, rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Stacked bars: each RL step's seconds in generation, preparation, update and sync."""
    timed = [r for r in rows if any(f"time/{p}_s" in r for p in TIME_PARTS)]
    if not timed:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(timed)
    steps = [r["step"] for r in timed]
    for part in TIME_PARTS:
        values = [float(r.get(f"time/{part}_s", 0.0)) for r in timed]
        ax.bar(steps, values, bottom=bottom, label=part, width=1.0)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("step")
    _integer_ticks(ax)
    ax.set_ylabel("seconds")
    ax.set_title("time per RL step")
    ax.legend()
    return _save(plt, fig, path)


TIMELINE = "time/timeline/"


def timeline_spans(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Lane (``stage@role``) -> (start, end) seconds since the run's start, over every step."""
    lanes: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        base = r.get(TIMELINE + "step_start_s")
        if not isinstance(base, int | float):
            continue
        for key, start in r.items():
            if not (key.startswith(TIMELINE) and key.endswith("_start_s") and "@" in key):
                continue
            lane = key[len(TIMELINE) : -len("_start_s")]
            end = r.get(TIMELINE + lane + "_end_s")
            if isinstance(end, int | float):
                lanes.setdefault(lane, []).append((base + start, base + end))
    return lanes


def lane_order(lanes: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Lanes top to bottom: a role's lanes together, roles and each role's lanes in the order
    they first ran."""
    first = {lane: min(start for start, _ in spans) for lane, spans in lanes.items()}
    role_first: dict[str, float] = {}
    for lane, start in first.items():
        role = lane.split("@", 1)[1]
        role_first[role] = min(start, role_first.get(role, start))

    def key(lane: str) -> tuple[float, str, float, str]:
        role = lane.split("@", 1)[1]
        return role_first[role], role, first[lane], lane

    return sorted(lanes, key=key)


def _timeline(plt: Any, rows: list[dict[str, Any]], path: Path) -> Path | None:
    """A Gantt chart: one lane per stage (or call) and role, a bar per step's span in it."""
    lanes = timeline_spans(rows)
    if not lanes:
        return None
    order = lane_order(lanes)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(order)))
    for y, lane in enumerate(order):
        bars = [(start, end - start) for start, end in lanes[lane]]
        ax.broken_barh(bars, (y - 0.4, 0.8), alpha=0.8)
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's start")
    ax.set_title("when each stage ran (RL steps)")
    ax.grid(axis="x", alpha=0.3)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
