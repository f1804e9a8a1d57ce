"""Where the trainer's records go: JSON lines, TensorBoard, W&B (offline), anything callable.

Every record is a flat dict with a global ``step``; numeric values become scalars. Samples (what
the model said: prompt, response, reward) take their own path: a sink that also has a
``samples`` method (``SampleSink``) gets them, ``JsonlSink`` into ``samples.jsonl`` beside the
metrics, ``TensorBoardSink`` as a table in TensorBoard's text tab. On resume the
JSONL file is cut back to the checkpoint's step first, so the steps redone after a crash are not
logged twice and a resumed run's file reads like a straight run's. A torn last line (the machine
lost power mid-write) is dropped with a warning; a bad line before the last is a ``MetricsError``
naming the file and line, since the file was damaged some other way and a person should look.
"""

from __future__ import annotations

import json
import logging
import numbers
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

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
                "a torn write; fix or delete that line"
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


#: One generated answer as logged: ``step``, ``stage``, ``kind`` (validation or rollout),
#: ``prompt``, ``response``, ``reward``, and ``answer`` / ``finish`` when the row had them.
Sample = dict[str, Any]
SAMPLES_FILE = "samples.jsonl"
SAMPLE_COLUMNS = ("prompt", "response", "reward", "answer")  # what a samples table shows


@runtime_checkable
class SampleSink(Protocol):
    """A sink that takes samples besides records (the trainer hands them to no other sink)."""

    def samples(self, rows: Sequence[Sample]) -> None: ...


def sample_sinks(sinks: Iterable[object]) -> list[SampleSink]:
    """The sinks among ``sinks`` that take samples."""
    return [sink for sink in sinks if isinstance(sink, SampleSink)]


def _cut_back(path: Path, resume_step: int | None) -> None:
    """Keep only the records of ``path`` up to ``resume_step`` (the checkpoint's; None: none),
    and every supervision event (a fault and its recovery stay on record)."""
    kept = [
        line
        for line, record in read_records(path)
        if "event" in record or (resume_step is not None and record.get("step", 0) <= resume_step)
    ]
    path.write_text("".join(line + "\n" for line in kept))


class JsonlSink:
    """``metrics.jsonl``, and the samples in ``samples.jsonl`` beside it (opened at the first)."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.samples_path = path.with_name(SAMPLES_FILE)
        for file in (path, self.samples_path):
            if resume_step is not None and file.exists():
                _cut_back(file, resume_step)
        if resume_step is None:
            self.samples_path.unlink(missing_ok=True)  # an earlier try's, in a reused run dir
        self.file = path.open("a" if resume_step is not None else "w")
        self.samples_file: TextIO | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def rewind(self, step: int | None) -> None:
        """The run rolled back to the checkpoint of ``step`` (None: to its start) in this
        process (``controller/supervisor.py``): drop the records and samples past it."""
        self.file.close()
        _cut_back(self.path, step)
        self.file = self.path.open("a")
        if self.samples_file is not None:
            self.samples_file.close()
            self.samples_file = None
        if self.samples_path.exists():
            _cut_back(self.samples_path, step)

    def samples(self, rows: Sequence[Sample]) -> None:
        if self.samples_file is None:
            self.samples_file = self.samples_path.open("a", encoding="utf-8")
        for row in rows:
            self.samples_file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.samples_file.flush()

    def close(self) -> None:
        self.file.close()
        if self.samples_file is not None:
            self.samples_file.close()


def read_samples(path: Path) -> list[Sample]:
    """The samples of a ``samples.jsonl`` file (none when it does not exist)."""
    return [record for _, record in read_records(path)] if path.is_file() else []


def markdown_table(rows: Sequence[Sample], columns: Sequence[str] = SAMPLE_COLUMNS) -> str:
    """Samples as a Markdown table (TensorBoard's text tab renders it), one row per sample."""
    shown = [c for c in columns if any(c in row for row in rows)]

    def cell(value: Any) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else "" if value is None else str(value)
        text = text if text or value is None else "(empty)"
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in shown) + " |" for row in rows]
    return "\n".join(lines)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers (a supervision event's are no curve: none)."""
    if "event" in record:
        return {}
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

    def samples(self, rows: Sequence[Sample]) -> None:
        """One table per kind and stage (``samples/validation/final``) in the text tab."""
        groups: dict[tuple[str, str, int], list[Sample]] = {}
        for row in rows:
            key = (str(row.get("kind", "")), str(row.get("stage", "")), int(row.get("step", 0)))
            groups.setdefault(key, []).append(row)
        for (kind, stage, step), picked in groups.items():
            self.writer.add_text(f"samples/{kind}/{stage}", markdown_table(picked), step)
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
