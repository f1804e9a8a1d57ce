"""``dtype: auto``: bf16 only where the CPU multiplies bf16 natively (its AMX-BF16 / AVX512-BF16
flags) or the GPU supports it, one dtype per group, recorded where a result is reported.

The flags are injected where a test decides what the CPU has; one test reads the real ones in
fresh processes on a loaded machine. The suite itself runs with ``HYBRIDFLOW_AUTO_DTYPE=fp32``
(``tests/conftest.py``) so its numbers do not depend on the CPU, and these tests clear it where
they test the choice.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roles.runtime.device import (
    AUTO_DTYPE_ENV,
    HOST_DEVICE,
    bf16_speedup,
    choose_dtype,
    cpu_bf16_flags,
    group_dtype,
)


def never() -> tuple[str, ...]:
    raise AssertionError("the CPU's flags were read although nothing asked for auto")


@pytest.mark.parametrize(
    ("flags", "expected", "reason"),
    [
        ((), "fp32", "auto: the CPU has no native bf16 (AMX-BF16 or AVX512-BF16)"),
        # AVX512-BF16 without AMX: a bf16 product ran at 0.47x fp32 on such a host
        (
            ("avx512_bf16",),
            "fp32",
            "auto: the CPU has avx512_bf16 but no AMX: bf16 multiplies slower",
        ),
        (("amx_bf16", "avx512_bf16"), "bf16", "auto: the CPU has amx_bf16 and avx512_bf16"),
    ],
)
def test_auto_on_a_cpu_follows_its_bf16_flags(
    flags: tuple[str, ...], expected: str, reason: str
) -> None:
    choice = choose_dtype("auto", HOST_DEVICE, lambda: flags, env={})
    assert (choice.dtype, choice.reason) == (expected, reason)
    assert choice.torch_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[expected]


def test_a_set_dtype_is_kept_without_looking() -> None:
    for dtype in ("fp32", "bf16"):
        choice = choose_dtype(dtype, HOST_DEVICE, never, env={AUTO_DTYPE_ENV: "fp32"})  # type: ignore[arg-type]
        assert (choice.dtype, choice.reason) == (dtype, "set in the config")


def test_the_environment_can_fix_what_auto_means() -> None:
    choice = choose_dtype("auto", HOST_DEVICE, never, env={AUTO_DTYPE_ENV: "bf16"})
    assert (choice.dtype, choice.reason) == ("bf16", f"auto: {AUTO_DTYPE_ENV}=bf16")
    with pytest.raises(ValueError, match=rf"{AUTO_DTYPE_ENV}='fp16'; use fp32 or bf16"):
        choose_dtype("auto", HOST_DEVICE, never, env={AUTO_DTYPE_ENV: "fp16"})


CHOOSE = (
    "import json; from roles.runtime.device import HOST_DEVICE, choose_dtype; "
    "c = choose_dtype('auto', HOST_DEVICE); print(json.dumps([c.dtype, c.reason]))"
)


@pytest.mark.extended  # ~110 s with its busy loops slowing the other worker too
def test_three_starts_on_a_loaded_machine_resolve_alike() -> None:
    """What the old timing got wrong: two busy loops per core load the machine while three fresh
    processes (as three starts of a run's ranks) resolve ``auto``; all agree, with what the
    flags say."""
    env = {k: v for k, v in os.environ.items() if k != AUTO_DTYPE_ENV}
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        found = [
            json.loads(
                subprocess.run(
                    [sys.executable, "-c", CHOOSE],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=120,
                    check=True,
                ).stdout
            )
            for _ in range(3)
        ]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert all(f == found[0] for f in found), found
    assert found[0][0] == ("bf16" if "amx_bf16" in cpu_bf16_flags() else "fp32")
    bench_only = bf16_speedup()  # the timing stays, for benchmarks: a ratio, once per process
    assert 0.01 < bench_only < 100 and bf16_speedup() == bench_only


def _vote(rank: int, store_dir: str, flags: tuple[bool, bool], out: str) -> None:
    os.environ.pop(AUTO_DTYPE_ENV, None)
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(store_dir) / "store"), 2)
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        mine = ("amx_bf16", "avx512_bf16") if flags[rank] else ()
        choice = group_dtype("auto", HOST_DEVICE, dist.group.WORLD, lambda: mine)
        Path(out, f"{rank}.txt").write_text(f"{choice.dtype}|{choice.reason}")
    finally:
        dist.destroy_process_group()


def vote(tmp_path: Path, flags: tuple[bool, bool]) -> list[list[str]]:
    out = tmp_path / f"vote-{flags[0]}-{flags[1]}"
    out.mkdir()
    mp.start_processes(
        _vote, args=(str(out), flags, str(out)), nprocs=2, start_method="spawn", join=True
    )
    return [(out / f"{r}.txt").read_text().split("|") for r in range(2)]


def test_a_group_computes_in_bf16_only_if_every_rank_has_it(tmp_path: Path) -> None:
    both = vote(tmp_path, (True, True))
    assert [d for d, _ in both] == ["bf16", "bf16"]
    split = vote(tmp_path, (True, False))
    assert [d for d, _ in split] == ["fp32", "fp32"]
    assert split[0][1].endswith("another rank of the group chose fp32")
    assert split[1][1] == "auto: the CPU has no native bf16 (AMX-BF16 or AVX512-BF16)"
