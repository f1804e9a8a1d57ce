"""``dtype: auto``: bf16 only where the hardware multiplies bf16 faster than fp32, one dtype per
group, recorded where a result is reported.

The probe is injected where a test decides what it measures; one test runs the real probe. The
suite itself runs with ``HYBRIDFLOW_AUTO_DTYPE=fp32`` (``tests/conftest.py``) so its numbers do not
depend on the CPU, and these tests clear it where they test the probe.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roles.runtime.device import (
    AUTO_DTYPE_ENV,
    BF16_MARGIN,
    HOST_DEVICE,
    bf16_speedup,
    choose_dtype,
    group_dtype,
)


def never() -> float:
    raise AssertionError("the probe ran although nothing asked for auto")


@pytest.mark.parametrize(
    ("speedup", "expected"),
    [
        (0.22, "fp32"),
        (1.0, "fp32"),
        (BF16_MARGIN - 0.01, "fp32"),
        (BF16_MARGIN, "bf16"),
        (2.9, "bf16"),
    ],
)
def test_auto_on_a_cpu_follows_the_measured_bf16_speedup(speedup: float, expected: str) -> None:
    choice = choose_dtype("auto", HOST_DEVICE, lambda: speedup, env={})
    assert choice.dtype == expected
    assert f"bf16 matmul runs {speedup:.2f}x fp32" in choice.reason
    assert choice.torch_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[expected]


def test_a_set_dtype_is_kept_without_probing() -> None:
    for dtype in ("fp32", "bf16"):
        choice = choose_dtype(dtype, HOST_DEVICE, never, env={AUTO_DTYPE_ENV: "fp32"})  # type: ignore[arg-type]
        assert (choice.dtype, choice.reason) == (dtype, "set in the config")


def test_the_environment_can_fix_what_auto_means() -> None:
    choice = choose_dtype("auto", HOST_DEVICE, never, env={AUTO_DTYPE_ENV: "bf16"})
    assert (choice.dtype, choice.reason) == ("bf16", f"auto: {AUTO_DTYPE_ENV}=bf16")
    with pytest.raises(ValueError, match=rf"{AUTO_DTYPE_ENV}='fp16'; use fp32 or bf16"):
        choose_dtype("auto", HOST_DEVICE, never, env={AUTO_DTYPE_ENV: "fp16"})


def test_the_real_probe_measures_a_ratio_once_per_process() -> None:
    ratio = bf16_speedup()
    assert 0.01 < ratio < 100
    assert bf16_speedup() == ratio  # cached: every engine of the process sees one answer


def _vote(rank: int, store_dir: str, speedups: tuple[float, float], out: str) -> None:
    os.environ.pop(AUTO_DTYPE_ENV, None)
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(store_dir) / "store"), 2)
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        choice = group_dtype("auto", HOST_DEVICE, dist.group.WORLD, lambda: speedups[rank])
        Path(out, f"{rank}.txt").write_text(f"{choice.dtype}|{choice.reason}")
    finally:
        dist.destroy_process_group()


def vote(tmp_path: Path, speedups: tuple[float, float]) -> list[list[str]]:
    out = tmp_path / f"vote-{speedups[0]}-{speedups[1]}"
    out.mkdir()
    mp.start_processes(
        _vote, args=(str(out), speedups, str(out)), nprocs=2, start_method="spawn", join=True
    )
    return [(out / f"{r}.txt").read_text().split("|") for r in range(2)]


def test_a_group_computes_in_bf16_only_if_every_rank_gains(tmp_path: Path) -> None:
    both = vote(tmp_path, (2.0, 1.8))
    assert [d for d, _ in both] == ["bf16", "bf16"]
    split = vote(tmp_path, (2.0, 0.3))
    assert [d for d, _ in split] == ["fp32", "fp32"]
    assert split[0][1].endswith("another rank of the group chose fp32")
    assert split[1][1] == "auto: bf16 matmul runs 0.30x fp32 on this CPU"
