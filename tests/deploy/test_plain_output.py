"""Output that is not a terminal is for grep and log parsers (``nohup``, SLURM, CI): one record
per line, never wrapped at 80 columns, and no library progress bar (carriage returns) mixed in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.terminal import PROGRESS_BARS_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# what a line of `hybridflow run` starts with: a progress record, the summary, the run folder
RECORD = re.compile(r"^(step \d+  \S+|quickstart: validation score|run: |run folder )")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_piped_to_a_file_prints_one_record_per_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", PROGRESS_BARS_ENV)}
    argv = ["run", str(EXAMPLES / "quickstart.yaml"), "--quick", "--run-dir", str(tmp_path / "r")]
    argv += ["--set", "stages.0.steps=6", "--set", "stages.1.steps=2"]  # what it prints, shorter
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=280,
    )
    out = done.stdout.decode()  # as bytes: text mode would turn a "\r" into a line break
    assert done.returncode == 0, out
    assert "\r" not in out  # no progress bar ("Writing model shards") drawn into the log
    lines = [line for line in out.splitlines() if line.strip()]
    assert [line for line in lines if not RECORD.match(line)] == []  # no torn-off remainder
    rl = [line for line in lines if re.match(r"step \d+  grpo  ", line)]
    assert rl and "reward" in rl[0]
    last = rl[-1]  # the stage's last step carries every field, the groups' idle shares last
    assert re.search(r"s/step [\d.]+  idle main \d+%$", last), last
    summary = next(line for line in lines if line.startswith("quickstart: "))
    assert len(summary) > 80 and summary.endswith(")")  # longer than 80 columns, in one piece
