"""``bench.generate``: its FLOP count by hand, and its quick form end to end.

The FLOP tests check ``useful_flops`` and ``hf_executed_flops`` on the tiny Llama's shape against
numbers worked out by hand. The slow test runs ``python -m bench.generate --sizes 1m --quick`` as
its own process (vLLM's parallel state is one per process) and checks the last line's keys and
that no engine reports more useful GFLOP/s than the GEMM peak measured in the same run allows: a
FLOP count that over-counts, or a peak measured wrong, fails it. Without the ``[vllm]`` extra
the vLLM keys must be null with the reason; under HYBRIDFLOW_REQUIRE_SYSTEM_TESTS=1 (CI) vLLM
must be there and measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from bench.generate import Shape, hf_executed_flops, useful_flops
from roles.modeling.models import SIZES
from tests.conftest import require_system

ROOT = Path(__file__).resolve().parents[2]
#: the tiny Llama: 4 layers, d 128, 4 heads and 2 kv heads of 32, MLP 512, vocab 320
TINY = Shape.of(LlamaConfig(vocab_size=320, **SIZES["tiny"]))
#: a peak is a peak: an engine above it (beyond timing noise) means a wrong count or peak
PEAK_SLACK = 1.05


def test_shape_of_the_tiny_llama() -> None:
    assert TINY == Shape(layers=4, hidden=128, attn=128, kv=64, ffn=512, vocab=320)
    # per layer q 128*128 + k, v 2 * 128*64 + o 128*128 + gate, up, down 3 * 128*512
    assert TINY.block_params == 4 * (16_384 + 16_384 + 16_384 + 196_608)


def test_useful_flops_by_hand() -> None:
    # prompt 3, response 2: 4 positions fed (3 prompt + the first new token), 1+2+3+4 = 10 keys,
    # the head on 2 positions
    one = 2 * 983_040 * 4 + 2 * 2 * 4 * 128 * 10 + 2 * 128 * 320 * 2
    assert one == 8_048_640
    assert useful_flops(TINY, [3], [2]) == one
    # prompt 1, response 3: 3 fed, 1+2+3 = 6 keys, the head on 3
    two = 2 * 983_040 * 3 + 2 * 2 * 4 * 128 * 6 + 2 * 128 * 320 * 3
    assert useful_flops(TINY, [3, 1], [2, 3]) == one + two == 14_204_928


def test_hf_executed_flops_by_hand() -> None:
    # prompts 3 and 1 left-padded to 3: prefill 2 rows x 3 positions, 2 x (1+2+3) keys, head 2;
    # then both rows decode until the longer response (3) is done: 2 steps at positions 3 and 4
    # (4 and 5 keys), head on every row
    prefill = 2 * 983_040 * 6 + 2 * 2 * 4 * 128 * 12 + 2 * 128 * 320 * 2
    decode = 2 * 983_040 * 4 + 2 * 2 * 4 * 128 * 18 + 2 * 128 * 320 * 4
    assert hf_executed_flops(TINY, [3, 1], [2, 3]) == prefill + decode == 20_213_760
    # padding and finished rows only add work: useful is a share of it
    assert useful_flops(TINY, [3, 1], [2, 3]) / (prefill + decode) == pytest.approx(0.7027, 1e-3)


@pytest.fixture(scope="module")
def quick_report() -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench.generate", "--sizes", "1m", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=270,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def check_engine(report: dict[str, Any], engine: str) -> None:
    peak = report["peak_gflops"]
    tok_s, gflops = report[f"{engine}_tok_s_1m"], report[f"{engine}_useful_gflops_1m"]
    assert tok_s > 0 and gflops > 0, (engine, report)
    assert gflops <= peak * PEAK_SLACK, f"{engine}: {gflops} useful GFLOP/s above the peak {peak}"
    # useful GFLOP/s is tokens/s times the useful work per token of this workload
    per_token = report["useful_gflop_1m"] / report["tokens_1m"]
    assert gflops == pytest.approx(tok_s * per_token, rel=0.01)
    assert report[f"{engine}_peak_frac_1m"] == pytest.approx(gflops / peak, abs=0.002)
    # one thread per process: CPU time cannot run ahead of the wall clock
    assert report[f"{engine}_cpu_per_wall_1m"] <= 1.25, (engine, report)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_reports_rates_within_the_peak(quick_report: dict[str, Any]) -> None:
    report = quick_report
    assert report["quick"] is True and report["batch_1m"] == 16 and report["max_new_1m"] == 32
    # 16 responses uniform in [8, 32]
    assert 16 * 8 <= report["tokens_1m"] <= 16 * 32
    assert 0 < report["hf_executed_share_1m"] < 1
    assert report["peak_gflops"] == max(report["peak_gflops_samples"])
    assert len(report["peak_gflops_samples"]) == 2  # before the one size, and at the end
    assert report["peak_gflops"] > 1
    for engine in ("native", "hf"):
        check_engine(report, engine)
    if importlib.util.find_spec("vllm") is None:
        assert report["vllm_tok_s_1m"] is None and report["vllm_useful_gflops_1m"] is None
        assert "[vllm]" in report["missing"]["vllm"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_measures_vllm(quick_report: dict[str, Any]) -> None:
    require_system(
        "vLLM (the [vllm] extra)",
        importlib.util.find_spec("vllm") is not None,
        "pip install -e '.[vllm]'",
    )
    assert "vllm" not in quick_report["missing"], quick_report["missing"]
    check_engine(quick_report, "vllm")
