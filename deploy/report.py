"""``hybridflow report RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` into ``RUN_DIR/plots``.

reward.png (train reward and validation score), kl.png, length.png (response length) and
time.png (per-step seconds split into generation, preparation, update and weight sync). A plot
whose metric the run never logged (e.g. KL without a reference) is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a run directory?")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no records yet")
    return rows


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    picked = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in picked], [float(v) for _, v in picked]


def write_report(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written: list[Path] = []

    def plot(name: str, title: str, lines: list[tuple[str, str]]) -> None:
        drawn = [(label, *series(rows, key)) for key, label in lines]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, steps, values in drawn:
            ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    plot("reward", "reward", [("train/reward/mean", "train reward"), ("val/score", "validation")])
    plot("kl", "KL to reference", [("train/kl", "kl"), ("train/kl_coef", "kl coef")])
    plot("length", "response length (tokens)", [("train/response/length", "train")])
    plot("sft", "SFT loss", [("train/loss", "train"), ("val/loss", "held-out")])

    parts = ("gen", "prepare", "update", "sync")
    timed = [r for r in rows if any(f"time/{p}_s" in r for p in parts)]
    if timed:
        fig, ax = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(timed)
        steps = [r["step"] for r in timed]
        for part in parts:
            values = [float(r.get(f"time/{part}_s", 0.0)) for r in timed]
            ax.bar(steps, values, bottom=bottom, label=part, width=1.0)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.set_title("time per RL step")
        ax.legend()
        fig.tight_layout()
        path = out / "time.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
