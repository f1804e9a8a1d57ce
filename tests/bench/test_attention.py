"""``bench.attention``: each column times the kernel it is named for, the time is thread CPU time
(best of the repeats, after a warm-up), and the quick form reports both kernels at both widths
and dtypes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.attention import step_time, thread_seconds
from roles.modeling.models import SIZES

ROOT = Path(__file__).resolve().parents[2]


def test_each_column_times_the_kernel_it_is_named_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench switches the kernel of a model already built; were that switch ignored (the
    kernel fixed when the model is made), both columns would time one kernel and every speed-up
    would be noise around 1. Counted: one kernel call per layer per forward, warm-up included."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    calls: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting("sdpa", sdpa))
    eager = modeling_llama.eager_attention_forward
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", counting("eager", eager))
    torch.manual_seed(0)
    layers = 2  # the bench's tiny model, fewer layers: the count is per layer
    shape = {**SIZES["tiny"], "num_hidden_layers": layers, "max_position_embeddings": 32}
    model = LlamaForCausalLM(LlamaConfig(**shape, vocab_size=259))
    for kernel in ("sdpa", "eager", "sdpa"):  # and back: the switch works both ways
        calls.clear()
        assert step_time(model, 32, "fp32", kernel, repeats=1) > 0
        assert calls == {kernel: layers * (1 + 1)}, kernel  # the warm-up and 1 repeat


def test_time_is_the_best_repeat_in_thread_cpu_seconds() -> None:
    """Waiting costs no thread CPU time, so another process holding the core does not count;
    the warm-up call is not timed and the fastest repeat is the one reported."""
    # per call (warm-up, then 3 repeats), seconds of waiting and of busy work: only the second
    # repeat has no busy work. Wall time, the first or last repeat, or the mean would be >= 0.04.
    spans = [0.0, 0.0, 0.3, 0.0]
    burn = [0.0, 0.06, 0.0, 0.06]
    done: list[int] = []

    def fn() -> None:
        i = len(done)
        time.sleep(spans[i])  # the behaviour: waiting, which wall time would count
        end = time.thread_time() + burn[i]
        while time.thread_time() < end:
            pass
        done.append(i)

    best = thread_seconds(fn, 3)
    assert done == [0, 1, 2, 3]  # warm-up + 3 repeats
    assert best < 0.02  # the repeat with no busy work, though it waited 0.3 s


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
    assert set(result["widths"]) == {"32", "128"}
    for width in ("32", "128"):
        for dtype in ("fp32", "bf16"):
            times = result["widths"][width][dtype]
            assert set(times) == {"sdpa", "eager"}
            assert all(0 < t < 60 for t in times.values())
            assert result["eager_speedup"][dtype][width] > 0
