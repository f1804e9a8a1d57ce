"""``hybridflow report RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` into ``RUN_DIR/plots``.

reward.png (train reward and validation score), kl.png, length.png (response length) and
time.png (per-step seconds split into generation, preparation, update and weight sync) and
timeline.png (when each stage ran, one lane per stage and role, from ``time/timeline/...``: the
actor's stages and every role's calls, e.g. ``update_critic@critic``; with ``max_staleness`` >= 1
on a rollout group the generation lane overlaps the update lane). A plot
whose metric the run never logged (e.g. KL without a reference) is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.metrics import read_records


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
        _time_split(plt, rows, out / "time.png"),
        _timeline(plt, rows, out / "timeline.png"),
    ]
    return [path for path in written if path is not None]


# (metric, label) per line of a plot
REWARD = [("train/reward/mean", "train reward"), ("val/score", "validation")]
KL = [("train/kl", "kl"), ("train/kl_coef", "kl coef")]
LENGTH = [("train/response/length", "train")]
SFT = [("train/loss", "train"), ("val/loss", "held-out")]
TIME_PARTS = ("gen", "prepare", "update", "sync")


def _pyplot() -> Any:
    """matplotlib's pyplot without a display (imported here: plotting is this command's only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _lines(
    plt: Any, rows: list[dict[str, Any]], path: Path, title: str, lines: list[tuple[str, str]]
) -> Path | None:
    """One line per metric the run logged; None (nothing drawn) when it logged none of them."""
    drawn = [(label, *series(rows, key)) for key, label in lines]
    drawn = [d for d in drawn if d[1]]
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, steps, values in drawn:
        ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


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
