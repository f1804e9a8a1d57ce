"""The device seam: a group's device kind and a rank's LOCAL_RANK decide its device and backend.

``decide`` is pure (the machine's CUDA device count is an argument), so every decision is checked
here without a GPU; the rank runtime and the local launcher both refuse a CUDA group on a machine
without CUDA at once, naming the group and the setting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deploy.session import local_session
from roles.runtime.device import DeviceError, decide
from roles.runtime.env import GroupEnv
from roles.runtime.rank import init_group
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import DeviceProbeClient
from transport.device import DeviceKind

NEEDS_NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)


def test_cpu_is_the_host_with_gloo_whatever_the_machine_has() -> None:
    for cuda_devices in (0, 8):
        d = decide(DeviceKind.CPU, local_rank=3, cuda_devices=cuda_devices, group="g")
        assert (d.kind, d.device, d.backend, d.type) == ("cpu", torch.device("cpu"), "gloo", "cpu")


def test_cuda_takes_the_gpu_of_its_local_rank_with_nccl() -> None:
    d = decide(DeviceKind.CUDA, local_rank=2, cuda_devices=4, group="g")
    assert (d.kind, d.device, d.backend, d.type) == (
        "cuda",
        torch.device("cuda", 2),
        "nccl",
        "cuda",
    )


def test_cuda_without_cuda_names_the_group_and_the_setting() -> None:
    with pytest.raises(DeviceError) as info:
        decide(DeviceKind.CUDA, local_rank=0, cuda_devices=0, group="train")
    message = str(info.value)
    assert "group 'train' has device=cuda but this machine has no CUDA device" in message
    assert "placement.train.device: cpu" in message


def test_more_local_ranks_than_gpus_is_refused() -> None:
    with pytest.raises(DeviceError, match=r"LOCAL_RANK=2 but this machine has 2 CUDA device"):
        decide(DeviceKind.CUDA, local_rank=2, cuda_devices=2, group="g")


def rank_env(**extra: str) -> dict[str, str]:
    base = {
        "HYBRIDFLOW_GROUP": "g",
        "HYBRIDFLOW_ROLES": "r",
        "HYBRIDFLOW_CONTROLLER": "ipc:///nowhere",
        "MASTER_PORT": "1",
        "RANK": "3",
        "WORLD_SIZE": "4",
    }
    return {**base, **extra}


def test_the_rank_reads_its_device_kind_and_local_rank_from_the_launcher() -> None:
    env = GroupEnv.from_env(rank_env())
    assert (env.device, env.local_rank) == (DeviceKind.CPU, 3)  # defaults: cpu; the rank
    env = GroupEnv.from_env(rank_env(HYBRIDFLOW_DEVICE="cuda", SLURM_LOCALID="1"))
    assert (env.device, env.local_rank) == (DeviceKind.CUDA, 1)
    assert GroupEnv.from_env(rank_env(LOCAL_RANK="0", SLURM_LOCALID="1")).local_rank == 0
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_DEVICE='tpu'; use one of cpu, cuda"):
        GroupEnv.from_env(rank_env(HYBRIDFLOW_DEVICE="tpu"))


@NEEDS_NO_CUDA
def test_a_rank_of_a_cuda_group_fails_before_it_joins_anyone() -> None:
    env = GroupEnv.from_env(rank_env(HYBRIDFLOW_DEVICE="cuda", RANK="0", WORLD_SIZE="2"))
    start = time.monotonic()
    with pytest.raises(DeviceError, match=r"group 'g' has device=cuda"):
        init_group(env)  # would wait group_init_s for rank 1 had it got to the store
    assert time.monotonic() - start < 5


@NEEDS_NO_CUDA
def test_a_local_cuda_group_fails_fast_naming_the_group(tmp_path: Path) -> None:
    async def main() -> None:
        spec = group("trainer", 2, echo="tests.fixtures.roles:Echo")
        placement = [spec.model_copy(update={"device": DeviceKind.CUDA})]
        async with local_session(placement, TEST_TIMEOUTS, run_dir=tmp_path):
            pass

    start = time.monotonic()
    with pytest.raises(DeviceError, match=r"placement\.trainer\.device: cpu"):
        run(main)
    assert time.monotonic() - start < 10
    assert not list((tmp_path / "logs").glob("trainer-*.log"))  # no rank was started


def test_ranks_get_the_seam_decision_and_their_group_uses_its_backend() -> None:
    async def main() -> dict[str, str]:
        placement = [group("g", 2, probe="tests.fixtures.roles:DeviceProbe")]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            seen: dict[str, str] = await DeviceProbeClient(c, "probe").device()
            return seen

    seen = run(main)
    assert seen == {"device": "cpu", "backend": "gloo", "group_backend": "gloo"}


def test_peak_memory_counts_from_the_last_reset_on_the_host() -> None:
    """A phase that touches 256 MiB peaks at least that far above one that touches nothing. In a
    fresh process, as a rank is: whether freed memory goes back to the system depends on the
    allocator's history, which in the test runner's own process is every earlier test's."""
    probe = """
import json, torch
from roles.runtime.device import HOST_DEVICE, peak_memory_bytes, reset_peak_memory
reset_peak_memory(HOST_DEVICE)
quiet = peak_memory_bytes(HOST_DEVICE)
reset_peak_memory(HOST_DEVICE)
big = torch.ones(64 << 20)  # 256 MiB, written so the pages are resident
busy = peak_memory_bytes(HOST_DEVICE)
del big
reset_peak_memory(HOST_DEVICE)
print(json.dumps([quiet, busy, peak_memory_bytes(HOST_DEVICE)]))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    quiet, busy, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert quiet > 0
    assert busy >= quiet + (240 << 20)
    assert after < busy - (200 << 20)  # the reset forgot the freed tensor


@NEEDS_NO_CUDA
def test_sft_on_cuda_without_cuda_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.cli import build_parser
    from roles.modeling.models import init_model

    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    argv = ["sft", "--model", str(model), "--out", str(tmp_path / "out"), "--device", "cuda"]
    args = build_parser().parse_args([*argv, "--steps", "2", "--run-dir", str(tmp_path / "run")])
    start = time.perf_counter()
    assert args.fn(args) == 2  # bad input
    assert time.perf_counter() - start < 20
    said = capsys.readouterr().err
    assert "group 'sft' has device=cuda but this machine has no CUDA device" in said
    assert not (tmp_path / "out").exists()


def test_the_random_state_kept_is_the_hosts_here_and_older_tensors_still_load() -> None:
    """On the host the CPU generator's state alone (tests/gpu: the GPU's beside it); a bare
    tensor, as checkpoints held it before, still restores."""
    from roles.runtime.device import HOST_DEVICE, rng_state, set_rng_state

    kept = rng_state(HOST_DEVICE)
    assert set(kept) == {"cpu"}
    first = torch.rand(4)
    set_rng_state(HOST_DEVICE, kept)
    assert torch.equal(torch.rand(4), first)
    set_rng_state(HOST_DEVICE, kept["cpu"])
    assert torch.equal(torch.rand(4), first)
