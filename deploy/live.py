"""The live view of a run: one table, redrawn on every record, on a terminal.

Shows the stage and step, reward, KL, response length, tokens/s, where the last step's time went
and the last validation score. When stderr is not a terminal (CI, a log file) it prints a plain
line every few steps instead, so logs stay readable.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


class LiveView:
    def __init__(self, exp: Any, console: Console, enabled: bool = True, every: int = 10) -> None:
        self.console, self.every = console, every
        self.totals = {s.name or f"stage{i}": s.steps for i, s in enumerate(exp.stages)}
        self.last: dict[str, Any] = {}
        self.val: dict[str, Any] = {}
        self.live: Live | None = None
        self.enabled = enabled
        self.tty = enabled and console.is_terminal

    def __enter__(self) -> LiveView:
        if self.tty:
            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None

    def __call__(self, record: dict[str, Any]) -> None:
        if any(k.startswith("val/") for k in record):
            self.val = record
        if "stage_step" in record:
            self.last = record
        if self.live is not None:
            self.live.update(self._table())
        elif self.enabled and self._due(record):
            self.console.print(self._line(record))

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
            ("time/step_s", "s/step"),
            ("val/score", "val"),
            ("val/loss", "val loss"),
        ):
            if key in r:
                parts.append(f"{label} {r[key]:.4g}")
        return "  ".join(parts)

    def _table(self) -> Table:
        r = self.last
        table = Table(title="hybridflow", show_header=False, expand=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        if r:
            stage = r.get("stage", "")
            table.add_row("stage", f"{stage}  {r['stage_step']}/{self.totals.get(stage, '?')}")
            table.add_row("global step", str(r["step"]))
        for key, label in (
            ("train/reward/mean", "reward"),
            ("train/loss", "sft loss"),
            ("train/kl", "kl"),
            ("train/response/length", "response length"),
            ("perf/tokens_per_s", "tokens/s"),
            ("time/step_s", "step s"),
        ):
            if key in r:
                table.add_row(label, f"{r[key]:.4g}")
        times = {k[5:-2]: v for k, v in r.items() if k.startswith("time/") and k != "time/step_s"}
        if times:
            table.add_row("time split", "  ".join(f"{k} {v:.2f}s" for k, v in times.items()))
        if self.val:
            shown = f"{self.val.get('val/score', float('nan')):.3f} at step {self.val['step']}"
            table.add_row("validation score", shown)
        return table
