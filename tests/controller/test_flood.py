"""A stranger flooding the controller's socket from its own process, as fast as it can and never
reading a reply, neither grows the controller's memory nor slows a run beside it.

The controller runs in this process (``local_session``), so this process's VmRSS is the
controller's, ZeroMQ's queues included; a thread samples it every 20 ms. A demo group trains
beside it: bursts of ``LinearRegressor.train_step`` calls, timed while nobody floods and while a
stranger does. Without the limits, a stranger queued 280,000 hellos a second in the
controller (+90 MB a second, held after it left) and the bursts took six times as long; the
stranger here floods for eight half-second segments, 4 s in all, which crosses the 200 MB bound
twice over without the limits: the report's 30 s are not needed to show it. The 1 GiB frames
are the report's other probe (ZeroMQ buffered each whole before the controller saw it).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import statistics
import time

import pytest

from controller.clients import LinearRegressorClient
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.controller.flood_measure import (
    LINEAR,
    MB,
    PeakWatch,
    burst,
    rss,
    start_stranger,
)

SEGMENT_S = 0.5
FLOODED_SEGMENTS = 8
STALL_S = 60  # the segments take ~9 s; without the limits, the first flooded one never ends
RSS_BOUND = 200 * MB
SLOWDOWN_BOUND = 1.25


async def _segment(model: LinearRegressorClient) -> float:
    """The median time of the bursts done within ``SEGMENT_S``."""
    times: list[float] = []
    started = time.monotonic()
    while time.monotonic() - started < SEGMENT_S:
        times.append(await burst(model))
    return statistics.median(times)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("attack", "size"),
    [("hellos", 0), ("frames", 1 << 30)],
    ids=["wrong-token-hellos", "1GiB-frames"],
)
def test_a_flooding_stranger_grows_no_memory_and_slows_no_calls(attack: str, size: int) -> None:
    async def main() -> tuple[int, int, list[float], int]:
        async with local_session([group("g", 1, linear=LINEAR)], TEST_TIMEOUTS) as c:
            model = LinearRegressorClient(c, "linear")
            for _ in range(5):
                await burst(model)
            gc.collect()
            baseline = rss()
            watch = PeakWatch()
            stranger = await start_stranger(c, attack, 600, size)  # ended below
            # Other developers' jobs share this machine's 2 cores and change its load from
            # one second to the next (bursts here took 24 ms, then 45 ms for half a second,
            # with nobody flooding). So the stranger is stopped and resumed (SIGSTOP, SIGCONT)
            # every half second, each flooded segment is compared with the mean of the quiet
            # segments on either side (a load that rises or falls across the three cancels to
            # first order), and the median of the eight ratios decides (a load spike spoils one
            # or two). Measured here: median ratios 0.95-1.05 with the limits; the bound is
            # the 25% asked for.
            quiet: list[float] = []
            ratios: list[float] = []
            try:
                async with asyncio.timeout(STALL_S):
                    os.kill(stranger.pid, signal.SIGSTOP)
                    quiet.append(await _segment(model))
                    for _ in range(FLOODED_SEGMENTS):
                        os.kill(stranger.pid, signal.SIGCONT)
                        flooded = await _segment(model)
                        os.kill(stranger.pid, signal.SIGSTOP)
                        quiet.append(await _segment(model))
                        ratios.append(flooded / statistics.mean(quiet[-2:]))
            except TimeoutError:
                pytest.fail(
                    f"the calls stalled under the flood: {len(ratios)} of {FLOODED_SEGMENTS} "
                    f"segments in {STALL_S} s; RSS +{(watch.stop() - baseline) / MB:.0f} MB"
                )
            finally:
                stranger.kill()
                await stranger.communicate()
            peak = watch.stop()
            gc.collect()
            return baseline, peak, ratios, rss()

    baseline, peak, ratios, after = run(main)
    print(
        f"{attack}: RSS baseline {baseline / MB:.0f} MB, peak +{(peak - baseline) / MB:.0f} MB, "
        f"after +{(after - baseline) / MB:.0f} MB; flooded/quiet burst time "
        f"{[round(r, 2) for r in ratios]}"
    )
    assert peak - baseline < RSS_BOUND
    assert after - baseline < RSS_BOUND
    assert statistics.median(ratios) <= SLOWDOWN_BOUND, ratios
