"""Where the trainer's records go: JSON lines, TensorBoard, W&B (offline), anything callable.

Every record is a flat dict with a global ``step``; numeric values become scalars. On resume the
JSONL file is cut back to the checkpoint's step first, so the steps redone after a crash are not
logged twice and a resumed run's file reads like a straight run's. A torn last line (the machine
lost power mid-write) is dropped with a warning; a bad line before the last is a ``MetricsError``
naming the file and line, since the file was damaged some other way and a person should look.
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridflow.metrics")


class MetricsError(ValueError):
    """A metrics file that cannot be continued; the message names the file, the line and the fix."""


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) for every record of a JSONL metrics file; a torn last line is dropped with
    a warning, any other unreadable line raises MetricsError."""
    text = path.read_text(encoding="utf-8", errors="replace")  # a torn write may end mid-character
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        record, problem = _record(line)
        if record is not None:
            records.append((line, record))
        elif i == len(lines) - 1:
            log.warning(
                "%s:%d: dropped a torn last line (%s; the run stopped mid-write): %.80s",
                path, number, problem, line,
            )  # fmt: skip
        else:
            raise MetricsError(
                f"{path}:{number}: not a JSON record ({problem}) and not the last line, so not "
                "a torn write; fix or delete that line, then resume"
            )
    return records


def _record(line: str) -> tuple[dict[str, Any] | None, str]:
    """The line's record, or None and what is wrong with it."""
    try:
        found = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, exc.msg
    if not isinstance(found, dict):
        return None, f"a JSON {type(found).__name__}, not an object"
    return found, ""


class JsonlSink:
    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and path.exists():
            kept = [
                line for line, record in read_records(path) if record.get("step", 0) <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a" if resume_step is not None else "w")

    def __call__(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)
    }


class TensorBoardSink:
    """Scalars under ``run_dir/tensorboard`` (``tensorboard --logdir RUN_DIR``)."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def __call__(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases in offline mode (``wandb sync`` uploads later); needs ``wandb``."""

    def __init__(self, folder: Path, project: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(
                "logging.wandb is on but the wandb package is not installed; "
                "pip install wandb, or set logging.wandb: false"
            ) from exc
        self.run = wandb.init(project=project, dir=str(folder), mode="offline", config=config)

    def __call__(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()
