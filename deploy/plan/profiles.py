"""The cost model's constants, per device kind: the one place they live.

Every number the planner's time and memory estimates use comes from a ``DeviceProfile``. The GPU
profiles are vendor peak figures scaled by an efficiency taken from published measurements, not
fitted to any result here; ``vm-2core`` (CPU) was measured on this project's 2-core VM (README, NOTES.md).
A profile can also be a JSON file with the same fields (a measured profile of another machine).

Fields:

- ``flops``: dense bf16 matmul FLOP/s one device sustains in training and prefill, i.e. peak x
  model FLOPs utilisation. A100: 312 TFLOP/s peak (NVIDIA A100 datasheet) x 0.45; Megatron-LM
  reports 0.44-0.52 MFU for GPT models on A100 (Narayanan et al. 2021), HybridFlow's own
  baselines run lower. H100 SXM: 989 TFLOP/s x 0.40. vm-2core: 200 GFLOP/s bf16 per core at the
  1024^3 matmul peak measured by bench.e2e_vs_trl, x 0.65 (the training step's measured share
  of that peak, README).
- ``mem_bw``: device memory bandwidth in B/s, what a decode step's weight and KV reads are bound
  by, x 0.8 achieved. A100-80GB 2.04 TB/s, H100 SXM 3.35 TB/s; vm-2core ~10 GB/s per core.
- ``mem_bytes``: memory per device usable by the job (Q): 80 GB minus ~4 GB for the CUDA context
  and allocator slack; vm-2core: 24 GiB / 2 ranks, minus the OS.
- ``intra_bw``: bus bandwidth of collectives between devices of one node, B/s. A100 NVLink 3:
  600 GB/s bidirectional, ~230 GB/s measured all-reduce bus bandwidth (nccl-tests); H100
  NVLink 4: ~370 GB/s. vm-2core: gloo over loopback, 1.03 GB/s measured (below).
- ``inter_bw``: per device between nodes. The paper's cluster: 800 Gbps InfiniBand per
  8-GPU machine = 12.5 GB/s per GPU; H100 pods commonly 400 Gbps per GPU = 50 GB/s.
- ``op_latency_s``: fixed cost of one layer's forward on one micro-batch (kernel launches,
  Python), which dominates tiny models; ~30 us per layer on GPUs (a dozen kernels of ~2.5 us),
  ~150 us on this CPU for the tiny Llama.
- ``collective_latency_s``: fixed cost of one collective call (NCCL ~10 us in a node). vm-2core:
  1.4 ms, measured: a 32-byte gloo all-reduce between two processes of this VM, median of 500
  (a 16 MB one ran at 1.03 GB/s bus bandwidth, the ``intra_bw`` here).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from transport.device import DeviceKind


class ProfileError(ValueError):
    """An unknown profile name or an unreadable profile file."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: float
    mem_bw: float
    mem_bytes: float
    intra_bw: float
    inter_bw: float
    op_latency_s: float
    collective_latency_s: float
    device: DeviceKind = DeviceKind.CUDA  # what the planned groups run on (--write writes it)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


GB = 1e9
PROFILES: dict[str, DeviceProfile] = {
    "a100": DeviceProfile(
        name="a100",
        flops=312e12 * 0.45,
        mem_bw=2.04e12 * 0.8,
        mem_bytes=76 * GB,
        intra_bw=230 * GB,
        inter_bw=12.5 * GB,
        op_latency_s=30e-6,
        collective_latency_s=10e-6,
    ),
    "h100": DeviceProfile(
        name="h100",
        flops=989e12 * 0.40,
        mem_bw=3.35e12 * 0.8,
        mem_bytes=76 * GB,
        intra_bw=370 * GB,
        inter_bw=50 * GB,
        op_latency_s=25e-6,
        collective_latency_s=10e-6,
    ),
    "vm-2core": DeviceProfile(
        name="vm-2core",
        flops=200e9 * 0.65,
        mem_bw=10 * GB,
        mem_bytes=10 * GB,
        intra_bw=1 * GB,
        inter_bw=1 * GB,
        op_latency_s=150e-6,
        collective_latency_s=1.4e-3,
        device=DeviceKind.CPU,
    ),
}


def load_profile(name_or_path: str) -> DeviceProfile:
    """A profile by name (``PROFILES``) or from a JSON file of its fields."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"--device-profile {name_or_path!r}: not one of {', '.join(PROFILES)} and no such file"
        )
    try:
        raw = json.loads(path.read_text())
        wanted = {f.name for f in fields(DeviceProfile)}
        missing = wanted - set(raw) - {"device"}  # a file without one: a GPU's
        if missing:
            raise ProfileError(f"{path}: profile lacks {', '.join(sorted(missing))}")
        kinds = [k.value for k in DeviceKind]
        if raw.get("device", DeviceKind.CUDA) not in kinds:
            raise ProfileError(f"{path}: device {raw['device']!r} is not one of {kinds}")
        found = {k: raw[k] for k in wanted if k in raw}
        found["device"] = DeviceKind(found.get("device", DeviceKind.CUDA))
        return DeviceProfile(**found)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ProfileError(f"{path}: not a profile JSON object: {exc}") from exc
