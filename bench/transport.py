"""Transport benchmark: how fast the controller reaches a role group, against Ray and memcpy.

Run ``python -m bench.transport`` (about half a minute on a 2-core box) or
``python -m bench.transport --quick`` (well under a minute, start-ups included). Everything runs
on this host in one go, in this order, each part in its own processes:

1. **Round trip, one-to-all** — one local session hosts ``tests.fixtures.roles:Echo`` on one 2-rank
   group per fan-out backend (``socket``, ``zmq``, ``rpc``); the controller awaits ``Echo.ping``
   (no arguments, returns ``None``) one call at a time, in blocks of ``BLOCK`` calls per backend
   with the blocks interleaved, so that all backends see the same machine state (on a 2-core VM
   the drift between two runs exceeds the differences between backends). Each sample is one call, controller → coordinator (rank 0) → rank 1 and
   rank 0's own share → back, timed with ``perf_counter_ns``. Reported as p50/p99 in µs and
   calls/s; ``calls_per_s_concurrent`` is the throughput with ``CONCURRENCY`` calls in flight
   (``asyncio.gather``). ``rtt_p50_us``/``rtt_p99_us``/``calls_per_s`` are those of the library's
   default backend (``default_fanout``); ``fastest_fanout_p50`` names this run's fastest.
2. **Bulk, controller → coordinator** — a 1-rank group (so exactly one receiver) gets a 16 MiB and
   a 256 MiB ``uint8`` tensor from an ordinary heap tensor in the controller through
   ``Echo.checksum``, which reads every byte before replying. A sample is call start → reply;
   the first transfer is a warm-up (it creates and pre-faults the shared-memory segment), then the
   median of the repetitions gives ``bulk_gbps_*`` (GB = 1e9 bytes). The returned checksum is
   compared with one computed here; a mismatch aborts the run. ``bulk_first_ms_*`` is the
   warm-up transfer, for reference. ``memcpy_gbps_*`` is the same payload copied by
   ``dst.copy_(src)`` into a pre-faulted heap buffer on one thread (median), the cost floor for
   moving those bytes once; transfers and memcpys run in alternating blocks of ``BULK_BLOCK``,
   each in its own steady state (one between two of the other would evict its working set from
   the 32 MiB L3), while drift in this VM's memory bandwidth still hits both alike. ``bulk_vs_memcpy_*`` = bulk / memcpy. A transfer
   copies the bytes once (into shared memory), the receiver then reads them from another core,
   and a control round trip comes on top, so even a perfect implementation of this design stays
   below 1; at 16 MiB the memcpy runs from cache (source and target fit a 32 MiB L3), which the
   cross-process path cannot match.
3. **Ray** — ``ray.init(num_cpus=2)`` with two actors whose ``ping`` does nothing; the driver
   calls both and ``ray.get``s the pair — the same one-to-all shape as (1). ``ray_rtt_p50_us``,
   ``ray_rtt_p99_us``, and ``ray_vs_hybridflow`` = Ray p50 / our p50 (higher is better for us).
   Ray runs last and is shut down before the process exits; if Ray is not installed (or fails to
   start) the keys are ``null`` and the Ray target is reported as skipped (not met).

Targets (PASS/FAIL in the table, all together in ``targets_met``): ``rtt_p50_us`` ≤ 250;
``ray_vs_hybridflow`` ≥ 4; ``bulk_vs_memcpy_16m`` and ``bulk_vs_memcpy_256m`` ≥ 0.5.

Output: progress on stderr, a table on stdout, and as the last stdout line one JSON object with
every number above (machine-readable; ``jq`` it). The exit status is 0 when the measurements ran
(missed targets included; add ``--strict`` to exit 1 on a miss) and non-zero on any error, such as
a checksum mismatch. Only the driver's own compute is pinned to one thread
(``torch.set_num_threads(1)``); on a 2-core box the controller, coordinator and worker share
the cores, so the numbers include scheduler hand-offs between them.

Trust the numbers only from an otherwise idle machine: ``other_cpu_pct`` is the CPU that
processes outside this benchmark used during parts 1 and 2 (% of one core; machine-wide busy time
minus this process tree's, so kernel work on our behalf shows up as a few %; Ray's daemons are not
all our children, so the Ray part is left out), and a warning is printed when it is over 20. Two
busy neighbours on two cores easily double the round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from controller.placement import GroupSpec, RoleSpec
from deploy.cli import run_async
from deploy.session import local_session
from tests.fixtures.clients import EchoClient

BACKENDS = ("socket", "zmq", "rpc")
DEFAULT_FANOUT = GroupSpec.model_fields["fanout"].default
BLOCK = 50  # round trips are measured in blocks per backend, the blocks interleaved
BLOCK_WARMUP = 5
BULK_BLOCK = 3  # transfers (then memcpys) per block
CONCURRENCY = 32
ECHO_CLS = "tests.fixtures.roles:Echo"
MiB = 1 << 20
BULK_SIZES = {"16m": 16 * MiB, "256m": 256 * MiB}

BUSY_WARN_PCT = 20.0  # other processes' CPU use (% of one core) that taints the numbers
TARGET_RTT_P50_US = 250.0
TARGET_RAY_RATIO = 4.0
TARGET_BULK_RATIO = 0.5

err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 110)


@dataclass(frozen=True)
class Plan:
    """How many iterations each part runs."""

    calls: int  # timed sequential calls per backend
    warmup_calls: int
    concurrent_rounds: int  # rounds of CONCURRENCY calls gathered at once
    bulk_reps: int  # blocks of BULK_BLOCK transfers (and as many memcpys) per size
    ray_calls: int

    @classmethod
    def pick(cls, quick: bool) -> Plan:
        if quick:
            return cls(300, 50, 10, 3, 300)
        return cls(3000, 300, 100, 8, 3000)


# -- small helpers --------------------------------------------------------------------------------
def _machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has used since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # all but idle and iowait (guest is in user)
    return busy / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    """CPU seconds of this process and of its reaped children (the ranks of ended sessions)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """How busy the machine is with work that is not this benchmark's, in % of one core.

    Machine-wide busy time minus this process tree's: a test run or a build next to the
    benchmark steals the cores it measures, and the numbers are then not this library's."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.t0, self.machine0, self.own0 = time.monotonic(), _machine_busy_s(), _own_busy_s()

    def pct(self) -> float | None:
        machine = _machine_busy_s()
        if machine is None or self.machine0 is None:
            return None
        other = (machine - self.machine0) - (_own_busy_s() - self.own0)
        return max(0.0, 100.0 * other / max(time.monotonic() - self.t0, 1e-3))


def percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def checksum(t: torch.Tensor) -> int:
    """The same wrapping int64 byte sum as ``Echo.checksum`` computes on the receiver."""
    raw = t.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    return int(raw[:whole].view(torch.int64).sum()) + int(raw[whole:].sum())


def rtt_summary(samples_ns: list[int]) -> dict[str, float]:
    us = [s / 1e3 for s in samples_ns]
    return {
        "p50": percentile(us, 50),
        "p99": percentile(us, 99),
        "calls_per_s": len(us) / (sum(us) / 1e6),
    }


def echo_group(nproc: int, name: str = "echo") -> GroupSpec:
    return GroupSpec(name=name, roles={"echo": RoleSpec(cls=ECHO_CLS)}, nproc=nproc, tp=1, pp=1)


# -- (1) round trip over each fan-out backend -----------------------------------------------------
def backend_group(backend: str) -> GroupSpec:
    """A 2-rank echo group reached through ``backend``; its role is named after it."""
    return GroupSpec.model_validate(
        {
            "name": backend,
            "roles": {f"echo_{backend}": RoleSpec(cls=ECHO_CLS)},
            "nproc": 2,
            "fanout": backend,
        }
    )


async def measure_rtt(plan: Plan) -> dict[str, dict[str, float]]:
    """All backends in one session, their calls interleaved round-robin, so each sees the same
    machine state: on a 2-core VM the noise between two runs is larger than the differences."""
    started = time.perf_counter()
    async with local_session([backend_group(b) for b in BACKENDS]) as controller:
        err.print(f"  {len(BACKENDS)} groups of 2 ready in {time.perf_counter() - started:.1f} s")
        clients = {b: EchoClient(controller, f"echo_{b}") for b in BACKENDS}
        for _ in range(plan.warmup_calls):
            for echo in clients.values():
                await echo.ping()
        gc.collect()
        samples: dict[str, list[int]] = {b: [] for b in BACKENDS}
        clock = time.perf_counter_ns
        for _ in range(plan.calls // BLOCK):
            for backend, echo in clients.items():
                for i in range(BLOCK + BLOCK_WARMUP):
                    t0 = clock()
                    await echo.ping()
                    if i >= BLOCK_WARMUP:  # the first calls after a switch find ranks asleep
                        samples[backend].append(clock() - t0)
        results = {b: rtt_summary(samples[b]) for b in BACKENDS}
        for backend, echo in clients.items():
            await asyncio.gather(*(echo.ping() for _ in range(CONCURRENCY)))  # warm-up
            t0 = clock()
            for _ in range(plan.concurrent_rounds):
                replies = await asyncio.gather(*(echo.ping() for _ in range(CONCURRENCY)))
                assert replies == [None] * CONCURRENCY
            elapsed_s = (clock() - t0) / 1e9
            results[backend]["calls_per_s_concurrent"] = (
                plan.concurrent_rounds * CONCURRENCY / elapsed_s
            )
    for backend, result in results.items():
        err.print(
            f"  [{backend}] p50 {result['p50']:.0f} µs  p99 {result['p99']:.0f} µs  "
            f"{result['calls_per_s']:.0f} calls/s  "
            f"{result['calls_per_s_concurrent']:.0f} calls/s with {CONCURRENCY} in flight"
        )
    return results


# -- (2) bulk tensors, controller → coordinator ---------------------------------------------------
def timed_memcpy(dst: torch.Tensor, src: torch.Tensor) -> int:
    t0 = time.perf_counter_ns()
    dst.copy_(src)
    return time.perf_counter_ns() - t0


async def measure_bulk(plan: Plan) -> dict[str, float]:
    """Transfers and memcpys of each size, in alternating blocks so both see the same machine
    state."""
    started = time.perf_counter()
    results: dict[str, float] = {}
    async with local_session([echo_group(1, "bulk")]) as controller:
        err.print(f"  [bulk] group of 1 ready in {time.perf_counter() - started:.1f} s")
        echo = EchoClient(controller, "echo")
        for key, nbytes in BULK_SIZES.items():
            payload = torch.empty(nbytes, dtype=torch.uint8).random_()  # plain heap tensor
            expected = checksum(payload)
            dst = torch.zeros_like(payload)
            dst.copy_(payload)  # every page of the memcpy target is faulted in before timing
            transfers: list[int] = []
            copies: list[int] = []
            t0 = time.perf_counter_ns()  # warm-up: creates and pre-faults the segment
            await echo.checksum(payload)
            first_ns = time.perf_counter_ns() - t0
            # Blocks of transfers and blocks of memcpys, alternating: each runs in its own
            # steady state (a memcpy between two transfers would evict the segment from the
            # cache, and the other way round), and drift in memory bandwidth hits both alike.
            for _ in range(plan.bulk_reps):
                for _ in range(BULK_BLOCK):
                    t0 = time.perf_counter_ns()
                    got = await echo.checksum(payload)
                    transfers.append(time.perf_counter_ns() - t0)
                    if got != expected:
                        raise RuntimeError(
                            f"bulk {key}: the coordinator's checksum {got} != local {expected}; "
                            "the bytes were corrupted in transit"
                        )
                copies.extend(timed_memcpy(dst, payload) for _ in range(BULK_BLOCK))
            bulk_ns, copy_ns = statistics.median(transfers), statistics.median(copies)
            results[f"bulk_gbps_{key}"] = nbytes / bulk_ns  # bytes per ns == GB/s
            results[f"memcpy_gbps_{key}"] = nbytes / copy_ns
            results[f"bulk_first_ms_{key}"] = first_ns / 1e6
            err.print(
                f"  [bulk] {nbytes // MiB} MiB: median {bulk_ns / 1e6:.2f} ms "
                f"→ {nbytes / bulk_ns:.2f} GB/s (checksums match); "
                f"memcpy {copy_ns / 1e6:.2f} ms → {nbytes / copy_ns:.2f} GB/s"
            )
            del payload, dst
            gc.collect()
    return results


# -- (3) Ray ---------------------------------------------------------------------------------------
def measure_ray(plan: Plan) -> dict[str, float] | None:
    """p50/p99 µs of calling two Ray actors' no-op ``ping`` and ``ray.get``-ing both."""
    try:
        import ray
    except ImportError as exc:
        err.print(
            f"[yellow]Ray is not importable ({escape(str(exc))}); skipping the Ray comparison "
            "(install it with: pip install -e '.\\[bench]')[/]"
        )
        return None
    try:
        return _ray_round_trips(ray, plan)
    except Exception as exc:  # Ray's failure must not throw away the numbers measured so far
        err.print(f"[red]the Ray comparison failed: {type(exc).__name__}: {escape(str(exc))}[/]")
        return None


def _ray_round_trips(ray: Any, plan: Plan) -> dict[str, float]:
    class Pinger:
        def ping(self) -> None:
            return None

    started = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            logging_level=logging.ERROR,
            log_to_driver=False,
            object_store_memory=256 * MiB,
        )
        actor_cls: Any = ray.remote(Pinger)
        actors: list[Any] = [actor_cls.remote() for _ in range(2)]
        ray.get([a.ping.remote() for a in actors])  # both actors are up
        err.print(f"  [ray] 2 actors ready in {time.perf_counter() - started:.1f} s")
        for _ in range(plan.warmup_calls):
            ray.get([a.ping.remote() for a in actors])
        gc.collect()
        samples: list[int] = []
        clock = time.perf_counter_ns
        for _ in range(plan.ray_calls):
            t0 = clock()
            ray.get([a.ping.remote() for a in actors])
            samples.append(clock() - t0)
        result = rtt_summary(samples)
    finally:
        ray.shutdown()
    err.print(f"  [ray] p50 {result['p50']:.0f} µs  p99 {result['p99']:.0f} µs")
    return result


# -- report ----------------------------------------------------------------------------------------
def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def build_report(
    rtt: dict[str, dict[str, float]], bulk: dict[str, float], ray_rtt: dict[str, float] | None
) -> dict[str, Any]:
    fastest = min(rtt, key=lambda b: rtt[b]["p50"])
    best = DEFAULT_FANOUT  # the headline numbers are what a user gets without choosing
    report: dict[str, Any] = {}
    for backend, r in rtt.items():
        report[f"rtt_p50_us_{backend}"] = _r(r["p50"])
        report[f"rtt_p99_us_{backend}"] = _r(r["p99"])
        report[f"calls_per_s_{backend}"] = _r(r["calls_per_s"], 0)
        report[f"calls_per_s_concurrent_{backend}"] = _r(r["calls_per_s_concurrent"], 0)
    report.update(
        default_fanout=best,
        fastest_fanout_p50=fastest,
        rtt_p50_us=_r(rtt[best]["p50"]),
        rtt_p99_us=_r(rtt[best]["p99"]),
        calls_per_s=_r(rtt[best]["calls_per_s"], 0),
        calls_per_s_concurrent=_r(rtt[best]["calls_per_s_concurrent"], 0),
        ray_rtt_p50_us=_r(ray_rtt["p50"]) if ray_rtt else None,
        ray_rtt_p99_us=_r(ray_rtt["p99"]) if ray_rtt else None,
        ray_vs_hybridflow=_r(ray_rtt["p50"] / rtt[best]["p50"], 2) if ray_rtt else None,
    )
    for key in BULK_SIZES:
        report[f"bulk_gbps_{key}"] = _r(bulk[f"bulk_gbps_{key}"], 2)
        report[f"memcpy_gbps_{key}"] = _r(bulk[f"memcpy_gbps_{key}"], 2)
        report[f"bulk_vs_memcpy_{key}"] = _r(
            bulk[f"bulk_gbps_{key}"] / bulk[f"memcpy_gbps_{key}"], 3
        )
        report[f"bulk_first_ms_{key}"] = _r(bulk[f"bulk_first_ms_{key}"])
    return report


def targets(report: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(name, measured, met) per target; met is None when it could not be measured."""
    ray_ratio = report["ray_vs_hybridflow"]
    rows: list[tuple[str, str, bool | None]] = [
        (
            f"rtt_p50_us ≤ {TARGET_RTT_P50_US:.0f}",
            f"{report['rtt_p50_us']} µs ({report['default_fanout']})",
            report["rtt_p50_us"] <= TARGET_RTT_P50_US,
        ),
        (
            f"Ray ≥ {TARGET_RAY_RATIO:.0f}x slower",
            "Ray unavailable" if ray_ratio is None else f"{ray_ratio}x",
            None if ray_ratio is None else ray_ratio >= TARGET_RAY_RATIO,
        ),
    ]
    for key in BULK_SIZES:
        ratio = report[f"bulk_vs_memcpy_{key}"]
        rows.append(
            (
                f"bulk {key.upper()} ≥ {TARGET_BULK_RATIO}x memcpy",
                f"{ratio}x",
                ratio >= TARGET_BULK_RATIO,
            )
        )
    return rows


def print_table(report: dict[str, Any], plan: Plan, quick: bool) -> None:
    table = Table(
        title=f"hybridflow transport ({'quick' if quick else 'full'} run, "
        f"{os.cpu_count()} CPUs, {platform.machine()})"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("note")
    for backend in BACKENDS:
        table.add_row(
            f"ping round trip, fan-out {backend}",
            f"p50 {report[f'rtt_p50_us_{backend}']} µs / p99 {report[f'rtt_p99_us_{backend}']} µs",
            f"{plan.calls} sequential calls, 2 ranks",
        )
        table.add_row(
            f"calls/s, fan-out {backend}",
            f"{report[f'calls_per_s_{backend}']:.0f} / {report[f'calls_per_s_concurrent_{backend}']:.0f}",
            f"sequential / {CONCURRENCY} in flight",
        )
    if report["ray_rtt_p50_us"] is None:
        table.add_row("Ray round trip", "n/a", "Ray unavailable (see stderr)")
    else:
        table.add_row(
            "Ray round trip (2 actors)",
            f"p50 {report['ray_rtt_p50_us']} µs / p99 {report['ray_rtt_p99_us']} µs",
            f"{report['ray_vs_hybridflow']}x our p50",
        )
    for key, nbytes in BULK_SIZES.items():
        table.add_row(
            f"bulk {nbytes // MiB} MiB → coordinator",
            f"{report[f'bulk_gbps_{key}']} GB/s",
            f"memcpy {report[f'memcpy_gbps_{key}']} GB/s, ratio {report[f'bulk_vs_memcpy_{key}']}",
        )
    other = report["other_cpu_pct"]
    table.add_row(
        "other processes' CPU (round trips, bulk)",
        "n/a" if other is None else f"{other:.0f}% of a core",
        "idle machine: trustworthy"
        if other is not None and other <= BUSY_WARN_PCT
        else "[yellow]busy machine: numbers are pessimistic[/]",
    )
    table.add_section()
    for name, measured, met in targets(report):
        verdict = (
            "[yellow]SKIP (FAIL)[/]" if met is None else "[green]PASS[/]" if met else "[red]FAIL[/]"
        )
        table.add_row(f"target: {name}", measured, verdict)
    out.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transport", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer iterations; under a minute")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    plan = Plan.pick(args.quick)
    started = time.perf_counter()
    load = OtherLoad()
    time.sleep(0.5)
    before = load.pct()
    if before is not None and before > BUSY_WARN_PCT:
        err.print(
            f"[yellow]warning: other processes keep {before:.0f}% of a core busy; expect slower, "
            "noisier numbers (run the benchmark on an otherwise idle machine)[/]"
        )
    load.start()

    err.print(f"[bold]round trip, fan-out {', '.join(BACKENDS)} (interleaved)[/]")
    rtt: dict[str, dict[str, float]] = run_async(lambda: measure_rtt(plan))
    err.print("[bold]bulk, controller → coordinator[/]")
    bulk: dict[str, float] = run_async(lambda: measure_bulk(plan))
    during = load.pct()  # before Ray: its daemons are not all our children, so they'd count
    err.print("[bold]Ray[/]")
    ray_rtt = measure_ray(plan)

    report = build_report(rtt, bulk, ray_rtt)
    met = all(bool(m) for _, _, m in targets(report))
    report["targets_met"] = met
    report["quick"] = args.quick
    report["other_cpu_pct"] = _r(during, 0)
    if during is not None and during > BUSY_WARN_PCT:
        err.print(
            f"[yellow]warning: other processes used {during:.0f}% of a core while we measured; "
            "these numbers understate the library (rerun on an otherwise idle machine)[/]"
        )
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print_table(report, plan, args.quick)
    sys.stdout.flush()
    print(json.dumps(report), flush=True)
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        err.print("[yellow]interrupted; every process was stopped[/]")
        sys.exit(130)
