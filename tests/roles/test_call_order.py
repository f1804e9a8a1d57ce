"""Two calls in flight to colocated roles of one group, each a collective with rank 0 and each
carrying more than a socket buffer holds: rank 0 must run its share of the first call before it
blocks on handing the second to a worker that is still inside the first one's collective (it
once sent first, and the group deadlocked until the collective timed out)."""

from __future__ import annotations

import asyncio
import time

from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import SummerClient

SUMMER = "tests.fixtures.roles:Summer"
PAYLOAD = "x" * (16 << 20)  # inline in the call's header: over any socket buffer


def test_concurrent_collective_calls_with_big_arguments_do_not_deadlock() -> None:
    async def main() -> tuple[list[int], float]:
        async with local_session([group("g", 2, a=SUMMER, b=SUMMER)], TEST_TIMEOUTS) as c:
            start = time.monotonic()
            found = await asyncio.gather(
                SummerClient(c, "a").total(PAYLOAD), SummerClient(c, "b").total(PAYLOAD)
            )
            return list(found), time.monotonic() - start

    totals, took = run(main)
    assert totals == [2 * len(PAYLOAD)] * 2
    assert took < 20.0  # the collective's own timeout (30 s) was never reached
