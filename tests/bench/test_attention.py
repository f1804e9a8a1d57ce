"""``bench.attention``'s quick form end to end: both kernels timed at both widths and dtypes,
and the reported speed-ups are the ratios of the reported times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_times_both_kernels() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.attention", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "attention" and result["model"] == "tiny"
    for width in ("32", "128"):
        for dtype in ("fp32", "bf16"):
            times = result["widths"][width][dtype]
            assert set(times) == {"sdpa", "eager"}
            assert all(0 < t < 60 for t in times.values())
            ratio = result["eager_speedup"][dtype][width]
            assert abs(ratio - times["sdpa"] / times["eager"]) < 0.01
