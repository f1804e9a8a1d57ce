"""The device seam: which device a rank computes on and which collective backend its group uses.

A placement names each group's device kind (``device: cpu|cuda``, carried to the ranks as
``HYBRIDFLOW_DEVICE``). This module turns that kind and the rank's ``LOCAL_RANK`` into a
``RankDevice``: ``cpu`` with gloo, or ``cuda:LOCAL_RANK`` with NCCL. ``init_group`` joins the
process group with its backend, and roles read it from ``RoleContext.device`` (mesh device type,
autocast device type) — so no engine spells a device or a backend out. ``decide`` is a pure
function of its inputs (how many CUDA devices this machine has is one), so tests check every
decision without a GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from transport.device import BACKENDS, HOST, DeviceKind

log = logging.getLogger("hybridflow.device")

#: the collective backend of each device kind


class DeviceError(RuntimeError):
    """A group asked for a device this machine cannot give it."""


@dataclass(frozen=True)
class RankDevice:
    """One rank's device and its group's collective backend."""

    kind: DeviceKind
    device: torch.device
    backend: str

    @property
    def type(self) -> str:
        """The device type torch APIs take (``init_device_mesh``, ``torch.autocast``)."""
        return self.device.type

    def activate(self) -> None:
        """Make this rank's device the current one (before the process group starts)."""
        if self.kind == DeviceKind.CUDA:
            torch.cuda.set_device(self.device)


#: every cpu rank's decision
HOST_DEVICE = RankDevice(DeviceKind.CPU, HOST, BACKENDS[DeviceKind.CPU])


def decide(kind: DeviceKind, local_rank: int, cuda_devices: int, group: str) -> RankDevice:
    """The device and backend of the rank ``local_rank`` (its index on this machine) of
    ``group`` when the machine has ``cuda_devices`` CUDA devices; a ``DeviceError`` naming the
    group and the setting when the machine cannot serve the kind."""
    kind = DeviceKind(kind)  # a plain "cpu" from a caller's config is fine; "tpu" is not
    if kind == DeviceKind.CPU:
        return HOST_DEVICE
    if cuda_devices == 0:
        raise DeviceError(
            f"group {group!r} has device={kind} but this machine has no CUDA device "
            f"(torch.cuda.is_available() is False); set placement.{group}.device: "
            f"{DeviceKind.CPU} (hybridflow role --device {DeviceKind.CPU}), or run the group on "
            "a machine with GPUs"
        )
    if not 0 <= local_rank < cuda_devices:
        raise DeviceError(
            f"group {group!r} has device={kind}: LOCAL_RANK={local_rank} but this machine has "
            f"{cuda_devices} CUDA device(s); start at most {cuda_devices} rank(s) per machine"
        )
    return RankDevice(kind, torch.device(kind, local_rank), BACKENDS[kind])


def cuda_devices() -> int:
    """CUDA devices this process can use (0 without CUDA, without touching any device)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(kind: DeviceKind, local_rank: int, group: str) -> RankDevice:
    """``decide`` for this machine."""
    return decide(kind, local_rank, cuda_devices() if kind == DeviceKind.CUDA else 0, group)


def check_device(kind: DeviceKind, group: str, ranks_here: int) -> None:
    """Fail fast when this machine cannot run ``ranks_here`` ranks of ``group`` (local ranks
    0 .. ranks_here - 1): a launcher calls this before it starts any of them here."""
    rank_device(kind, ranks_here - 1, group)


# -- compute dtype ---------------------------------------------------------------------------
#
# ``dtype: auto`` (every role's default) means bf16 where the hardware runs bf16 matrix products
# natively and fp32 elsewhere. CPUs of one machine type differ: with AMX / AVX512-BF16 a bf16
# product runs 1.6-2.9x faster than fp32, without them it is emulated and 4.5x slower (measured,
# ../shared/NOTES.md). The choice follows what the CPU *is*, its flags (``cpu_bf16_flags``), not a
# timing: a one-product timing under load swung 0.8x-12x between starts of one config on one
# machine, so two runs of a config (or a restarted group and the run it rejoins) computed in
# different dtypes. On CUDA it asks the device. The ranks of a group then agree (bf16 only if
# every rank has it), so one group never mixes dtypes.

Precision = Literal["auto", "fp32", "bf16"]
Dtype = Literal["fp32", "bf16"]
#: forces what ``auto`` resolves to (``fp32`` or ``bf16``) without probing: reproducible runs and
#: tests across machines whose CPUs differ
AUTO_DTYPE_ENV = "HYBRIDFLOW_AUTO_DTYPE"
#: CPU flags that mean native bf16 matrix products (``/proc/cpuinfo``'s names)
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
TORCH_DTYPES: dict[Dtype, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DtypeChoice:
    """What a rank computes in, and why (logged, and reported to the controller)."""

    dtype: Dtype
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


def _median_seconds(fn: Callable[[], object], repeats: int = 7, inner: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / inner


@functools.cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """Which of ``BF16_FLAGS`` this CPU has (``/proc/cpuinfo``; elsewhere torch's own cpuinfo
    reader, which knows AVX512-BF16 and AMX tiles). Read once per process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        found = []
        if torch.cpu._is_avx512_bf16_supported():
            found.append("avx512_bf16")
        if torch.cpu._is_amx_tile_supported():
            found.append("amx_bf16")
        return tuple(found)
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return tuple(f for f in BF16_FLAGS if f in flags)


@functools.cache
def bf16_speedup() -> float:
    """fp32 time / bf16 time of one [64x384]·[384x1024] product on this CPU (one thread, as a
    rank computes); > 1 means bf16 is faster. Measured once per process (about 20-80 ms); for
    benchmarks and the planner's calibration, never for ``dtype: auto`` (it swings with load)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 384, generator=generator)
    b = torch.randn(384, 1024, generator=generator)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    for _ in range(3):  # warm-up: first calls pick kernels and fault pages in
        torch.mm(a, b), torch.mm(a16, b16)
    return _median_seconds(lambda: torch.mm(a, b)) / _median_seconds(lambda: torch.mm(a16, b16))


def choose_dtype(
    requested: Precision,
    device: RankDevice,
    flags: Callable[[], tuple[str, ...]] = cpu_bf16_flags,
    env: Mapping[str, str] | None = None,
) -> DtypeChoice:
    """This rank's dtype for ``requested``: an explicit ``fp32``/``bf16`` as given; ``auto`` from
    ``HYBRIDFLOW_AUTO_DTYPE`` if set, from the GPU's bf16 support on CUDA, else from the CPU's
    bf16 ``flags`` (injectable, so tests decide what the CPU has): bf16 with AMX-BF16, which
    multiplies bf16 about 2x faster than fp32; not with AVX512-BF16 alone, where a bf16 product
    measured 0.47x fp32."""
    if requested != "auto":
        return DtypeChoice(requested, "set in the config")
    forced = (os.environ if env is None else env).get(AUTO_DTYPE_ENV, "")
    if forced:
        if forced not in TORCH_DTYPES:
            raise ValueError(f"{AUTO_DTYPE_ENV}={forced!r}; use fp32 or bf16 (or unset it)")
        picked: Dtype = "bf16" if forced == "bf16" else "fp32"
        return DtypeChoice(picked, f"auto: {AUTO_DTYPE_ENV}={forced}")
    if device.kind == DeviceKind.CUDA:
        native = torch.cuda.is_bf16_supported()
        return DtypeChoice(
            "bf16" if native else "fp32", f"auto: bf16 supported by the GPU: {native}"
        )
    found = flags()
    if "amx_bf16" in found:
        return DtypeChoice("bf16", f"auto: the CPU has {' and '.join(found)}")
    if found:  # AVX512-BF16 alone: its bf16 products ran at 0.47x fp32 where measured
        return DtypeChoice(
            "fp32", f"auto: the CPU has {' and '.join(found)} but no AMX: bf16 multiplies slower"
        )
    return DtypeChoice("fp32", "auto: the CPU has no native bf16 (AMX-BF16 or AVX512-BF16)")


def group_dtype(
    requested: Precision,
    device: RankDevice,
    group: dist.ProcessGroup | None,
    flags: Callable[[], tuple[str, ...]] = cpu_bf16_flags,
) -> DtypeChoice:
    """``choose_dtype`` agreed over ``group``: bf16 only if every rank chose it, so the ranks of
    one group always compute in one dtype."""
    mine = choose_dtype(requested, device, flags)
    if group is None or dist.get_world_size(group) == 1:
        log.info("compute dtype %s (%s)", mine.dtype, mine.reason)
        return mine
    vote = torch.tensor([1 if mine.dtype == "bf16" else 0], dtype=torch.int32, device=device.device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    agreed: Dtype = "bf16" if int(vote.item()) == 1 else "fp32"
    if agreed == mine.dtype:
        choice = mine
    else:
        choice = DtypeChoice(agreed, f"{mine.reason}; another rank of the group chose fp32")
    log.info("compute dtype %s (%s)", choice.dtype, choice.reason)
    return choice


#: the widest row (tokens) for which ``attention: auto`` picks eager attention on CPU in bf16
EAGER_MAX_WIDTH = 512


def attention_kernel(choice: str, device: RankDevice, dtype: str, width: int) -> str:
    """The attention implementation of a training forward over rows ``width`` tokens wide.

    ``sdpa`` and ``eager`` are taken as given. ``auto`` is eager for bf16 on CPU up to
    ``EAGER_MAX_WIDTH`` tokens: there torch's CPU flash-attention kernel (fused, bf16) runs its
    backward at a few GFLOP/s, and plain matmuls + softmax make the whole training step 10-30%
    faster on short RL rows (``python -m bench.attention`` measures both on this machine); past
    that width, and in fp32 or on CUDA, the fused kernel wins or ties, so auto keeps ``sdpa``.
    """
    if choice != "auto":
        return choice
    eager = device.kind == DeviceKind.CPU and dtype == "bf16" and width <= EAGER_MAX_WIDTH
    return "eager" if eager else "sdpa"


# -- peak memory per phase -------------------------------------------------------------------
#
# What a phase (a generation, an optimizer step) needed at most on this rank: on CUDA the caching
# allocator's high-water mark of tensor bytes; on the host the process's peak resident set
# (``VmHWM``), which Linux resets when "5" is written to ``/proc/self/clear_refs``. The host
# figure counts everything the process holds (interpreter, libraries, weights), not only tensors.

_STATUS, _CLEAR = "/proc/self/status", "/proc/self/clear_refs"


def rng_state(device: RankDevice) -> dict[str, torch.Tensor]:
    """This rank's random state as checkpoints and snapshots keep it: the CPU generator's, and
    on CUDA its GPU's too (dropout on the GPU draws from the GPU's generator, so a replayed
    ``forward_backward`` draws the same masks only when that one is restored)."""
    state = {"cpu": torch.get_rng_state()}
    if device.kind == DeviceKind.CUDA:
        state["cuda"] = torch.cuda.get_rng_state(device.device)
    return state


def set_rng_state(device: RankDevice, state: dict[str, torch.Tensor] | torch.Tensor) -> None:
    """``rng_state``'s state back (a bare tensor: the CPU's alone, as older checkpoints held)."""
    found = {"cpu": state} if isinstance(state, torch.Tensor) else state
    torch.set_rng_state(found["cpu"])
    if "cuda" in found and device.kind == DeviceKind.CUDA:
        torch.cuda.set_rng_state(found["cuda"], device.device)


def reset_peak_memory(device: RankDevice) -> None:
    """Start a new phase: the next ``peak_memory_bytes`` counts from here."""
    if device.kind == DeviceKind.CUDA:
        torch.cuda.reset_peak_memory_stats(device.device)
        return
    try:
        with open(_CLEAR, "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then counts from the process's start
        pass


def peak_memory_bytes(device: RankDevice) -> int:
    """The most this rank held since ``reset_peak_memory`` (0 where the host cannot say)."""
    if device.kind == DeviceKind.CUDA:
        return int(torch.cuda.max_memory_allocated(device.device))
    try:
        with open(_STATUS) as f:
            found = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0
