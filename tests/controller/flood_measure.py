"""Measuring a controller under a flood: its resident memory, the time a burst of calls takes,
and the by-hand measurements with the full-length figures (a minute or more each, not tests).

``python -m tests.controller.flood_measure calls SECONDS [ATTACK [SIZE [PEERS]]]`` runs a real
controller in this process with one demo group (``roles.demo:LinearRegressor``), times bursts of
calls undisturbed, then while a stranger process (``tests.controller.flood_peer``) floods the
controller for SECONDS, then after it has left until they are back to normal. It prints the
controller's resident memory (baseline, peak while flooded, after), the CPU share of the
controller and of the stranger while flooded, and the burst times. The controller is this
process, so its VmRSS is the controller's memory, ZeroMQ's queues included.

``python -m tests.controller.flood_measure run SECONDS [STEPS]`` runs ``hybridflow run
examples/quickstart.yaml --quick`` with a GRPO stage of STEPS steps (60: ~12 s on 2 cores), twice:
undisturbed, then with a ``hellos`` flood of SECONDS from the stage's first step on. It prints
the GRPO stage's time each way and the controller process's resident memory.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from controller.clients import LinearRegressorClient
from controller.server import Controller
from deploy.session import local_session
from tests.conftest import group, run
from tests.waiting import cpu_seconds
from transport.batch import TensorBatch
from transport.settings import Timeouts

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20
CALLS = 50  # one burst: ~25 ms on an idle 2-core VM
LINEAR = ("roles.demo:LinearRegressor", {"dim": 4})
RECOVERY_S = 300  # how long bursts are timed after the stranger left, at most


def rss(pid: int | None = None) -> int:
    """VmRSS of process ``pid`` (this one by default), in bytes."""
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakWatch:
    """The highest VmRSS of this process, sampled every 20 ms from a thread (the event loop may
    be busy with the flood: it must not decide when memory is looked at)."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


async def burst(model: LinearRegressorClient, calls: int = CALLS) -> float:
    """Seconds that ``calls`` training steps on a small batch take, one after another."""
    x = torch.randn(16, 4)
    batch = TensorBatch.from_dict({"x": x, "y": x.sum(dim=1, keepdim=True)})
    started = time.monotonic()
    for _ in range(calls):
        await model.train_step(batch)
    return time.monotonic() - started


async def start_stranger(
    c: Controller, attack: str, seconds: float, size: int = 0, peers: int = 1
) -> asyncio.subprocess.Process:
    """A ``flood_peer`` process flooding ``c``'s first address, returned once it floods."""
    argv = [c.addresses[0], attack, str(seconds), str(size), str(peers)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.controller.flood_peer",
        *argv,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    assert line == b"flooding\n", f"the stranger did not start: {line!r}"
    return proc


async def _measure(seconds: float, attack: str, size: int, peers: int) -> None:
    placement = [group("g", 1, linear=LINEAR)]
    async with local_session(placement, Timeouts(call_s=max(600.0, 20 * seconds))) as c:
        model = LinearRegressorClient(c, "linear")
        for _ in range(3):
            await burst(model)
        cpu0, wall0 = cpu_seconds(os.getpid()), time.monotonic()
        quiet = [await burst(model) for _ in range(40)]
        quiet_cpu = (cpu_seconds(os.getpid()) - cpu0) / (time.monotonic() - wall0)
        gc.collect()
        baseline = rss()
        watch = PeakWatch()
        cpu0, wall0 = cpu_seconds(os.getpid()), time.monotonic()
        proc = await start_stranger(c, attack, seconds, size, peers)
        pid, stranger_cpu = proc.pid, 0.0
        flooded = []
        wait = asyncio.ensure_future(proc.communicate())
        while not wait.done():
            flooded.append(await burst(model))
            try:
                stranger_cpu = cpu_seconds(pid)
            except OSError:
                pass  # it has exited
        out = (await wait)[0].decode().strip()
        wall = time.monotonic() - wall0
        cpu = (cpu_seconds(os.getpid()) - cpu0) / wall
        left = time.monotonic()
        after = [await burst(model)]
        normal = 1.25 * statistics.median(quiet)
        while after[-1] > normal and time.monotonic() - left < RECOVERY_S:
            after.append(await burst(model))
        recovered = time.monotonic() - left
        peak = watch.stop()
        gc.collect()
        held = rss()
        print(f"stranger ({peers} connection(s)): {out}")
        print(f"burst of {CALLS} calls undisturbed: median {statistics.median(quiet):.3f} s")
        print(
            f"while flooded: median {statistics.median(flooded):.3f} s over {len(flooded)} "
            f"bursts, max {max(flooded):.3f} s"
        )
        print(
            f"after it: first burst {after[0]:.3f} s, "
            + (
                f"back within 25% of undisturbed {recovered:.1f} s after the stranger left"
                if after[-1] <= normal
                else f"not back within 25% of undisturbed {recovered:.0f} s after it left"
            )
        )
        print(
            f"controller RSS: baseline {baseline / MB:.0f} MB, peak +{(peak - baseline) / MB:.0f}"
            f" MB, after +{(held - baseline) / MB:.0f} MB; CPU while flooded: controller "
            f"{cpu:.0%} (undisturbed {quiet_cpu:.0%}), stranger {stranger_cpu / wall:.0%}; "
            "messages refused or dropped: "
            f"{c.rejections.total}"
        )


def measure(seconds: float, attack: str = "hellos", size: int = 0, peers: int = 1) -> None:
    run(lambda: _measure(seconds, attack, size, peers))


def _grpo_rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("stage") == "grpo" and "stage_step" in r]


def _run_once(work: Path, steps: int, flood_s: float) -> tuple[float, int, int, int]:
    """(GRPO stage seconds from its first step to the run's end, controller RSS at the first
    step, its peak, and messages the stranger got out) of one quick quickstart run."""
    tmp = work / "tmp"
    tmp.mkdir(parents=True)
    run_dir = work / "run"
    argv = [sys.executable, "-m", "deploy.cli", "run", str(REPO / "examples/quickstart.yaml")]
    argv += ["--quick", "--set", f"stages.1.steps={steps}", "--run-dir", str(run_dir)]
    env = {**os.environ, "TMPDIR": str(tmp)}  # its socket folder: tmp/hf-*/controller
    with open(work / "run.log", "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    while not _grpo_rows(run_dir):
        assert proc.poll() is None, f"the run ended early: {(work / 'run.log').read_text()}"
        time.sleep(0.05)
    started, base = time.monotonic(), rss(proc.pid)
    stranger = None
    if flood_s:
        address = f"ipc://{next(tmp.glob('hf-*/controller'))}"
        argv = [sys.executable, "-m", "tests.controller.flood_peer", address, "hellos"]
        stranger = subprocess.Popen([*argv, str(flood_s)], cwd=REPO, stdout=subprocess.PIPE)
    peak = base
    while proc.poll() is None:
        try:
            peak = max(peak, rss(proc.pid))
        except (OSError, RuntimeError):
            break  # it is exiting
        time.sleep(0.05)
    proc.wait()
    took = time.monotonic() - started
    sent = 0
    if stranger is not None:
        out = stranger.communicate()[0].decode()
        sent = int(out.split()[-5]) if out.split() else 0
    return took, base, peak, sent


def measure_run(flood_s: float, steps: int = 60) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        quiet = _run_once(Path(tmp) / "quiet", steps, 0)
        flooded = _run_once(Path(tmp) / "flooded", steps, flood_s)
    for name, (took, base, peak, sent) in (("undisturbed", quiet), ("flooded", flooded)):
        print(
            f"{name}: GRPO stage ({steps} steps) {took:.1f} s; controller RSS at its start "
            f"{base / MB:.0f} MB, peak +{(peak - base) / MB:.0f} MB"
            + (f"; the stranger got {sent} hellos out in {flood_s:g} s" if sent else "")
        )


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "run":
        measure_run(float(args[0]), *(int(a) for a in args[1:2]))
    else:
        measure(float(args[0]), *args[1:2], *(int(a) for a in args[2:4]))
