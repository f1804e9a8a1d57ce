"""The weight gate on its own (pure asyncio): generation holders share it, a push waits for all of
them, generation that asks while a push waits goes after the push, and one holder object can be
entered again after each exit (a batch's chunks)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from controller.streaming import WeightGate


async def until(holds: Callable[[], bool]) -> None:
    """Let the other tasks run until ``holds()`` (each turn of the loop runs every ready task)."""
    for _ in range(100):
        if holds():
            return
        await asyncio.sleep(0)
    raise AssertionError("the state never came")


def test_holders_share_the_gate_and_a_push_goes_between_them() -> None:
    async def main() -> list[str]:
        gate, order = WeightGate(), []
        first, second = gate.generating(), gate.generating()
        await first.__aenter__()
        await second.__aenter__()  # a second holder does not wait for the first
        order.append("both generating")

        async def push() -> None:
            async with gate.push():
                order.append("push")

        async def late() -> None:
            async with gate.generating():
                order.append("late generation")

        pushing = asyncio.create_task(push())
        await until(lambda: gate._pushes == 1)  # the push is waiting for the holders
        waiting = asyncio.create_task(late())
        await first.__aexit__(None, None, None)
        assert not pushing.done()  # the second holder still holds
        await second.__aexit__(None, None, None)
        await asyncio.gather(pushing, waiting)
        again = gate.generating()
        for _ in range(2):  # one object, entered twice
            async with again:
                order.append("chunk")
        return order

    order = asyncio.run(main())
    assert order == ["both generating", "push", "late generation", "chunk", "chunk"]
