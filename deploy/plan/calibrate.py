"""``hybridflow plan --calibrate``: measure a ``DeviceProfile`` on the present machine.

The measured device is one of this machine's CPU cores, as a rank here computes on one (one
intra-op thread each). Each profile field gets its own small measurement, each timed as a median:

- ``flops``: a forward + backward pass of a Llama-shaped model (``CALIBRATION_MODEL``, about
  6M parameters) in the dtype this CPU trains fastest in (bf16 where it beats fp32). The FLOPs
  are counted with the cost model's own formula (``ModelShape.forward_flops`` x 3), so the rate
  is what the planner divides by: the peak times the utilisation a training pass reaches. The
  1024^3 matmul peak is measured too and reported beside it (``detail.matmul_flops``).
- ``mem_bw``: copying a 256 MB tensor into another (bytes read + bytes written per second).
- ``mem_bytes``: this machine's physical memory x 0.85 (the OS and the controller keep the
  rest), shared by one rank per core.
- ``intra_bw`` and ``collective_latency_s``: two processes in a gloo group on this machine, a
  16 MB all-reduce (ring bus bandwidth, 2 (n-1)/n x bytes / seconds) and a 32-byte one. One
  machine has no inter-node link, so ``inter_bw`` is set to ``intra_bw`` (``detail`` says so).
- ``op_latency_s``: the fixed cost of one layer's forward on one token: the forward of a
  narrow 10-layer model minus that of a 2-layer one, over the 8 layers between.

``calibrate(quick=True)`` uses fewer repeats and smaller sizes (a few seconds; the tests run it).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deploy.plan.cost import ModelShape
from deploy.plan.profiles import DeviceProfile
from reshard.shapes import LlamaDims
from roles.runtime.device import bf16_speedup
from transport.device import BACKENDS, DeviceKind

#: the model whose training pass gives ``flops``: hidden 256, 4 layers, 4 heads (2 kv), vocab 320
CALIBRATION_MODEL = LlamaDims(256, 1024, 4, 4, 2, 320)
MEMORY_SHARE = 0.85
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class Calibration:
    profile: DeviceProfile
    dtype: str
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        """The profile's fields (``load_profile`` reads them) plus how they were measured."""
        out: dict[str, Any] = {
            f: getattr(self.profile, f) for f in self.profile.__dataclass_fields__
        }
        out["calibration"] = {"dtype": self.dtype, "seconds": self.seconds, **self.detail}
        return out


def _median(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: kernel choice, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, n: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    return 2 * n**3 / _median(lambda: torch.mm(a, b), repeats)


def _llama(dims: LlamaDims, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=dims.vocab,
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=dims.tied,
    )
    config._attn_implementation = "eager" if dtype == torch.bfloat16 else "sdpa"
    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(config)
    return model.to(dtype=dtype)


def training_flops(dtype: torch.dtype, batch: int, seq: int, repeats: int) -> float:
    """The cost model's FLOPs of forward + backward over ``batch x seq`` tokens per second."""
    model = _llama(CALIBRATION_MODEL, CALIBRATION_MODEL.layers, dtype)
    ids = torch.randint(0, CALIBRATION_MODEL.vocab, (batch, seq), generator=torch.Generator())

    def step() -> None:
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

    seconds = _median(step, repeats)
    flops = 3 * ModelShape(CALIBRATION_MODEL).forward_flops(batch * seq, seq)
    return flops / seconds


def op_latency(dtype: torch.dtype, repeats: int) -> float:
    """Seconds one layer adds to a one-token forward (a 10-layer minus a 2-layer model)."""
    narrow = LlamaDims(64, 128, 2, 2, 1, 320)
    ids = torch.zeros(1, 1, dtype=torch.long)
    times: dict[int, float] = {}
    for layers in (2, 10):
        model = _llama(narrow, layers, dtype)

        def forward(m: torch.nn.Module = model) -> object:
            return m(input_ids=ids)

        with torch.no_grad():
            times[layers] = _median(forward, repeats)
    return max(1e-7, (times[10] - times[2]) / 8)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median(lambda: dst.copy_(src), repeats)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_worker(rank: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        BACKENDS[DeviceKind.CPU],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        small, big = torch.ones(8), torch.ones(nbytes // 4)

        def timed(t: torch.Tensor) -> float:
            dist.barrier()
            return _median(lambda: dist.all_reduce(t), repeats)

        latency, seconds = timed(small), timed(big)
        if rank == 0:
            out.put((latency, seconds))
    finally:
        dist.destroy_process_group()


def collective(nbytes: int, repeats: int) -> tuple[float, float]:
    """(latency s of a 32-byte all-reduce, bus bandwidth B/s of an ``nbytes`` one) between two
    processes of this machine."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_collective_worker, args=(r, port, nbytes, repeats, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        latency, seconds = queue.get(timeout=COLLECTIVE_TIMEOUT_S + 30)
    except Exception as exc:
        raise RuntimeError(
            f"the calibration all-reduce between two processes gave no result within "
            f"{COLLECTIVE_TIMEOUT_S + 30:.0f} s (COLLECTIVE_TIMEOUT_S in deploy/plan/calibrate.py)"
        ) from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return latency, 2 * (2 - 1) / 2 * nbytes / seconds


def physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(quick: bool = False, name: str = "calibrated") -> Calibration:
    """Measure this machine (one core per device) into a profile; ``quick``: a few seconds."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = torch.bfloat16 if bf16_speedup() > 1 else torch.float32
        repeats = 3 if quick else 7
        peak = matmul_flops(dtype, 512 if quick else 1024, repeats)
        flops = training_flops(dtype, 2 if quick else 8, 64 if quick else 128, repeats)
        mem_bw = copy_bandwidth((32 if quick else 256) << 20, repeats)
        layer_s = op_latency(dtype, 5 if quick else 21)
    finally:
        torch.set_num_threads(threads)
    latency, bus_bw = collective((4 if quick else 16) << 20, 20 if quick else 100)
    cores = os.cpu_count() or 1
    profile = DeviceProfile(
        name=name,
        flops=flops,
        mem_bw=mem_bw,
        mem_bytes=physical_memory() * MEMORY_SHARE / cores,
        intra_bw=bus_bw,
        inter_bw=bus_bw,
        op_latency_s=layer_s,
        collective_latency_s=latency,
        device=DeviceKind.CPU,  # measured on this machine's cores
    )
    bad = [
        f
        for f, v in vars(profile).items()
        if f not in ("name", "device") and not (math.isfinite(v) and v > 0)
    ]
    if bad:
        raise RuntimeError(f"calibration measured a non-positive {', '.join(bad)}: {profile}")
    detail = {
        "matmul_flops": peak,
        "training_share_of_matmul_peak": flops / peak,
        "cores": cores,
        "inter_bw": "not measured: one machine; set to intra_bw",
        "quick": quick,
    }
    return Calibration(
        profile, str(dtype).removeprefix("torch."), time.perf_counter() - start, detail
    )
