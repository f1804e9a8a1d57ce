"""The live view of a run: one table, redrawn on every record, on a terminal.

Shows the run folder, the stage and step, the time left in the stage (its remaining steps at the
mean step time of the last ``WINDOW`` steps), reward, KL, response length, tokens/s, where the
last step's time went and the last validation score. When stderr is not a terminal (CI, a log file) it prints a plain
line every few steps instead, one record per line however long (never wrapped), so logs stay
readable and greppable. While the table is drawn, library progress bars are off
(``deploy/terminal.py``): a bar's carriage returns would tear the table.

In RL stages a **pipeline** panel has one row per role group: the stages it ran in the last step
(from the records' ``time/timeline/<stage>@<role>`` spans, a role mapped to the group that hosts
it; every role's calls are spans, e.g. ``compute_values@critic``, so a group without the actor is
busy while its roles compute), and its idle fraction over the last ``WINDOW`` steps: 1 - (the union of its spans inside the
window) / (the window's wall time, from the first step's start to the last one's end). Batches
generated ahead (``max_staleness`` k >= 1) are spans that began in earlier steps; they count where
they fall. The staleness in use (mean and max of the last step) sits beside it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from deploy.experiment import placement
from deploy.terminal import quiet_library_progress

#: steps the pipeline panel's idle fractions cover
WINDOW = 10
_PREFIX = "time/timeline/"


def spans(record: Mapping[str, Any]) -> list[tuple[str, str, float, float]]:
    """(stage, role, start, end) of a step record's timeline, in seconds since the run began."""
    base = record.get(f"{_PREFIX}step_start_s")
    if base is None:
        return []
    found = []
    for key, start in record.items():
        if key.startswith(_PREFIX) and key.endswith("_start_s") and "@" in key:
            name = key[len(_PREFIX) : -len("_start_s")]
            end = record.get(f"{_PREFIX}{name}_end_s")
            if end is not None:
                stage, role = name.split("@", 1)
                found.append((stage, role, base + float(start), base + float(end)))
    return found


def _covered(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside the union of ``intervals``."""
    total, reach = 0.0, lo
    for start, end in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def pipeline(
    records: Iterable[Mapping[str, Any]], group_of: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """Per group: the stages of the last step and the idle fraction over ``records`` (module
    docstring). ``group_of`` maps a role to the group that hosts it."""
    steps = [r for r in records if f"{_PREFIX}step_start_s" in r and "time/step_s" in r]
    groups = sorted(set(group_of.values()))
    found: dict[str, dict[str, Any]] = {g: {"last": [], "idle": None} for g in groups}
    if not steps:
        return found
    lo = float(steps[0][f"{_PREFIX}step_start_s"])
    hi = float(steps[-1][f"{_PREFIX}step_start_s"]) + float(steps[-1]["time/step_s"])
    busy: dict[str, list[tuple[float, float]]] = {g: [] for g in groups}
    for record in steps:
        for _, role, start, end in spans(record):
            if role in group_of:
                busy[group_of[role]].append((start, end))
    for stage, role, _, _ in sorted(spans(steps[-1]), key=lambda s: s[2]):
        if role in group_of and stage not in found[group_of[role]]["last"]:
            found[group_of[role]]["last"].append(stage)
    for g in groups:
        if hi > lo:
            found[g]["idle"] = max(0.0, 1.0 - _covered(busy[g], lo, hi) / (hi - lo))
    return found


class LiveView:
    def __init__(
        self,
        exp: Any,
        console: Console,
        enabled: bool = True,
        every: int = 10,
        run_dir: Path | None = None,
    ) -> None:
        self.console, self.every, self.run_dir = console, every, run_dir
        self.totals = {s.name or f"stage{i}": s.steps for i, s in enumerate(exp.stages)}
        self.last: dict[str, Any] = {}
        self.val: dict[str, Any] = {}
        self.live: Live | None = None
        self.enabled = enabled
        self.tty = enabled and console.is_terminal
        self.group_of = {
            role: name for name, group in placement(exp).items() for role in group.roles
        }
        self.recent: deque[dict[str, Any]] = deque(maxlen=WINDOW)
        self.faults: list[dict[str, Any]] = []  # supervision events (controller/supervisor.py)

    def __enter__(self) -> LiveView:
        if self.enabled and not self.tty and self.run_dir is not None:
            self.console.print(f"run folder {self.run_dir}", soft_wrap=True, markup=False)
        if self.tty:
            quiet_library_progress()
            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None

    def __call__(self, record: dict[str, Any]) -> None:
        if "event" in record:  # a fault, a restart or a rollback: always said
            self.faults.append(record)
            if self.live is not None:
                self.live.update(self._table())
            elif self.enabled:
                self.console.print(event_line(record), soft_wrap=True, markup=False)
            return
        if any(k.startswith("val/") for k in record):
            self.val = record
        if "stage_step" in record:
            if self.last.get("stage") != record.get("stage"):
                self.recent.clear()  # idle fractions of one stage at a time
            self.last = record
            self.recent.append(record)
        if self.live is not None:
            self.live.update(self._table())
        elif self.enabled and self._due(record):
            self.console.print(self._line(record), soft_wrap=True, markup=False, highlight=False)

    def _due(self, record: dict[str, Any]) -> bool:
        if "stage_step" not in record:
            return True  # validations always
        k, total = record["stage_step"], self.totals.get(record["stage"], 0)
        return k == 1 or k == total or k % self.every == 0

    def _line(self, r: dict[str, Any]) -> str:
        parts = [f"step {r['step']}", str(r.get("stage", ""))]
        for key, label in (
            ("train/reward/mean", "reward"),
            ("train/loss", "loss"),
            ("train/kl", "kl"),
            ("train/response/length", "len"),
            ("perf/tokens_per_s", "tok/s"),
            ("rollout/dynamic/kept_token_share", "kept"),
            ("agent/turns", "turns"),
            ("agent/tool_calls", "calls"),
            ("agent/tool_errors", "tool errors"),
            ("agent/tool_latency_p99_s", "tool p99 s"),
            ("agent/generator_idle_share", "gen idle"),
            ("time/step_s", "s/step"),
            ("val/score", "val"),
            ("val/loss", "val loss"),
        ):
            if key in r:
                parts.append(f"{label} {r[key]:.4g}")
        idle = {g: row["idle"] for g, row in pipeline(self.recent, self.group_of).items()}
        if "stage_step" in r and len(self.recent) > 1 and None not in idle.values():
            parts.append("idle " + " ".join(f"{g} {v:.0%}" for g, v in idle.items()))
        left = self.stage_left_s(r)
        if left is not None:
            parts.append(f"stage eta {duration(left)}")
        return "  ".join(parts)

    def stage_left_s(self, r: Mapping[str, Any]) -> float | None:
        """Seconds the stage of record ``r`` still needs: its remaining steps at the mean step
        time of the last steps seen (None before a step, or at the stage's end)."""
        if "stage_step" not in r:
            return None
        left = self.totals.get(r["stage"], 0) - int(r["stage_step"])
        times = [x["time/step_s"] for x in self.recent if "time/step_s" in x]
        if left <= 0 or not times:
            return None
        return left * sum(times) / len(times)

    def _table(self) -> Table:
        r = self.last
        table = Table(title="hybridflow", show_header=False, expand=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        if self.run_dir is not None:
            table.add_row("run folder", str(self.run_dir))
        if r:
            stage = r.get("stage", "")
            table.add_row("stage", f"{stage}  {r['stage_step']}/{self.totals.get(stage, '?')}")
            left = self.stage_left_s(r)
            if left is not None:
                table.add_row("stage eta", duration(left))
            table.add_row("global step", str(r["step"]))
        for key, label in (
            ("train/reward/mean", "reward"),
            ("train/loss", "sft loss"),
            ("train/kl", "kl"),
            ("train/response/length", "response length"),
            ("perf/tokens_per_s", "tokens/s"),
            ("agent/turns", "turns per trajectory"),
            ("agent/tool_calls", "tool calls per trajectory"),
            ("agent/tool_errors", "tool errors (step)"),
            ("agent/tool_latency_p50_s", "tool latency p50 s"),
            ("agent/tool_latency_p99_s", "tool latency p99 s"),
            ("agent/generator_idle_share", "generator idle share"),
            ("time/step_s", "step s"),
        ):
            if key in r:
                table.add_row(label, f"{r[key]:.4g}")
        times = {
            k[5:-2]: v
            for k, v in r.items()
            if k.startswith("time/") and k != "time/step_s" and not k.startswith(_PREFIX)
        }
        if times:
            table.add_row("time split", "  ".join(f"{k} {v:.2f}s" for k, v in times.items()))
        if self.val:
            shown = f"{self.val.get('val/score', float('nan')):.3f} at step {self.val['step']}"
            table.add_row("validation score", shown)
        for name, row in pipeline(self.recent, self.group_of).items():
            if row["idle"] is None:
                continue
            doing = ", ".join(row["last"]) or "-"
            table.add_row(
                f"group {name}", f"{doing}  idle {row['idle']:.0%} (last {len(self.recent)} steps)"
            )
        if self.faults:
            restarts = [e for e in self.faults if e["event"] != "fault"]
            faults = len(self.faults) - len(restarts)
            table.add_row(
                "restarts",
                f"{faults} fault(s), {len(restarts)} recovered; last: {event_line(self.faults[-1])}",
            )
        if "train/staleness" in r:
            table.add_row(
                "staleness",
                f"mean {r['train/staleness']:.2f}  max {r.get('train/staleness_max', 0):.0f}",
            )
        return table


def event_line(e: dict[str, Any]) -> str:
    """One supervision event in words."""
    group = e.get("group", "?")
    if e["event"] == "fault":
        rank = "" if e.get("rank") is None else f" rank {e['rank']}"
        return f"group {group}{rank} died at step {e.get('step', '?')}: {e.get('cause', '')}"
    if e["event"] == "rollback":
        return (
            f"rolled back to the last checkpoint after group {group} died ({e['recover_s']:.1f} "
            f"s to restart {', '.join(e.get('groups', []))}; {e['steps_replayed']} step(s) to replay)"
        )
    return f"group {group} restarted in {e['recover_s']:.1f} s"


def duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
