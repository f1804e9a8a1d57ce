"""The JSONL metrics sink on resume: a torn last line (power lost mid-write) is dropped with a
warning; a damaged line before the last is an error naming the file and the line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from controller.metrics import JsonlSink, MetricsError

RECORDS = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))


def test_resume_drops_a_torn_last_line_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(RECORDS.encode() + b'{"step": 4, "loss": 0.2\xe2\x82')  # cut mid-character
    with caplog.at_level(logging.WARNING, logger="hybridflow.metrics"):
        sink = JsonlSink(path, resume_step=3)
    sink({"step": 4, "loss": 0.25})
    sink.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert f"{path}:4: dropped a torn last line" in caplog.text


def test_resume_cuts_back_to_the_checkpoint_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(RECORDS + "\n")
    JsonlSink(path, resume_step=2).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("bad", ['{"step": 2, "lo', "[1, 2]"])
def test_a_damaged_line_before_the_last_names_file_and_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = RECORDS.splitlines()
    path.write_text("\n".join([lines[0], bad, *lines[1:]]) + "\n")
    with pytest.raises(MetricsError, match=f"{path}:2: not a JSON record .* not the last line"):
        JsonlSink(path, resume_step=3)
    assert len(path.read_text().splitlines()) == 4  # left as it was, for a person to look at
